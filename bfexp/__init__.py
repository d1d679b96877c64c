"""bfexp: declarative experiments for decentralized deep learning."""

__version__ = "0.1.0"
