"""Generated protobuf/gRPC code for the pdcluster.v1 API (see proto/)."""
