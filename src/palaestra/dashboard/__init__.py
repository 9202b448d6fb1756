"""The dashboard: a local, read-only web app over the run registry, evals and endpoints.

``palaestra dashboard`` serves it; ``records`` holds the readers the CLI shares. Nothing here
imports FastAPI until the app itself is built, so the CLI stays quick to start.
"""
