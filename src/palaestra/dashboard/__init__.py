"""The dashboard: a local, read-only web app over the run registry, evals and endpoints.

``palaestra dashboard`` serves it. It reads only through the run store (``palaestra.runs``).
Nothing here imports FastAPI until the app itself is built, so the CLI stays quick to start.
"""
