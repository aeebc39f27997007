"""The pure decision core: no grpc, no sockets, no clock reads, no unseeded randomness."""
