"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``runtime.AsyncEngine``."""
