"""The ext_proc protocol shell: the only package that speaks Envoy's gRPC protocol."""
