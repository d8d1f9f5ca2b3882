"""The OpenAI-compatible HTTP server (``trellm serve``): see ``api_server.build_app``."""
