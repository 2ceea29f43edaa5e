"""The HTTP server: FastAPI app, tokenizer manager, DP controller and one scheduler process per DP rank.

Start it with ``python -m sglang_lite.launch_server``; docs/architecture.md ("Serving") describes the process model.
"""
