"""Process wiring for `extproc serve`: gRPC server, admin HTTP, reload, shutdown."""
