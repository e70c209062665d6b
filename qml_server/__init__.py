"""qml_server: the OpenAI-compatible HTTP server over the qml engine, and the `qml` CLI."""

from qml_server.app import create_app

__all__ = ["create_app"]
