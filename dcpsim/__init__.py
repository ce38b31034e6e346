"""dcpsim: a distributed simulation harness for Decode Context Parallel KV-cache layouts."""

__version__ = "0.1.0"
