"""Serving plumbing every worker and the router use: worker host, Redis registry, heartbeats, discovery, prefix-cache index, gRPC helpers, worker configuration."""
