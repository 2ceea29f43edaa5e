"""Images in requests: decoding image URLs (``media``), the Qwen3.5 image processor (``image_processor``) and how a
request's images travel to its rank (``inputs``). The package's ``__init__`` imports nothing, so that importing
``inputs`` (numpy only) does not pull in torch or PIL."""
