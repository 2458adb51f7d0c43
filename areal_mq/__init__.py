"""areal-mq: fully asynchronous RL for language models as a ZeroMQ message-queue actor system."""
__version__ = "0.1.0"
