"""gRPC API server: servicers, interceptors, upload spooling, the embedded worker pool."""
