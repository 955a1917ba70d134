"""zmq-rpc package."""
