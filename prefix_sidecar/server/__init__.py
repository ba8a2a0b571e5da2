"""The gRPC sidecar server."""
