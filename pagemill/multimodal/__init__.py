"""Images in: decoding and validating images (multimodal/image.py), the model's HF processor expanding each image's
placeholder and producing its pixels (multimodal/processing.py), image parts of chat messages (multimodal/chat.py).

What reaches the engine core is a list of `messages.MultiModalFeature` per request: content hash, placeholder span,
processed pixels. The model runner encodes each image once (worker/encoder_cache.py)."""
