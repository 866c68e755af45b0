"""OpenAI-compatible HTTP API in front of the scheduler (docs/ARCHITECTURE.md, "The HTTP gateway").

A thin shell: HTTP in app.py; the translation between OpenAI's JSON and the client SDK lives in
plain functions (openai_request, openai_response, usage, auth, upstream) tested on their own.
"""
