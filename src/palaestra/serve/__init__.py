"""Serving: the OpenAI-compatible app, its server process, and the Endpoint handle."""

from palaestra.serve.endpoint import Endpoint, EndpointError

__all__ = ["Endpoint", "EndpointError"]
