"""Image parts of chat messages (OpenAI's `image_url` parts; offline also `image_pil`): the conversation with each
image replaced by the model's image placeholder in the text, and the images loaded and checked."""

from __future__ import annotations

from typing import Any

from pagemill.multimodal.image import MultiModalInputError, check_image, load_image_url

IMAGE_PART_TYPES = ("image_url", "image_pil")


def first_image_part(conversation: list[dict[str, Any]]) -> str | None:
    """The request field of the first image part (messages.I.content.J), or None."""
    for i, m in enumerate(conversation):
        content = m.get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES:
                    return f"messages.{i}.content.{j}"
    return None


def has_images(conversation: list[dict[str, Any]]) -> bool:
    """Whether any message carries an image part."""
    return first_image_part(conversation) is not None


def take_images(conversation: list[dict[str, Any]], image_token: str | None
                ) -> tuple[list[dict[str, Any]], list[tuple[str, Any, str]]]:
    """(the conversation with text contents, each image part in `image_token`'s place and the parts joined by
    newlines; the image sources in order as (kind, value, request field)). `image_token` None: a model without
    images, and any image part is a MultiModalInputError naming it."""
    out, sources = [], []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        pieces = []
        for j, part in enumerate(content):
            param = f"messages.{i}.content.{j}"
            if not isinstance(part, dict):
                raise MultiModalInputError("a content part must be an object with a type.", param)
            kind = part.get("type")
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind in IMAGE_PART_TYPES:
                if image_token is None:
                    raise MultiModalInputError("this model takes no images.", param)
                value = part.get(kind)
                if kind == "image_url" and isinstance(value, dict):
                    value = value.get("url")
                sources.append((kind, value, f"{param}.{kind}"))
                pieces.append(image_token)
            else:
                raise MultiModalInputError(f"unsupported content part type {kind!r} (text, image_url).",
                                           f"{param}.type")
        out.append({**message, "content": "\n".join(pieces)})
    return out, sources


def load_images(sources: list[tuple[str, Any, str]], allowed_local_media_path: str | None = None) -> list[Any]:
    """The images of `take_images`' sources, decoded and checked (errors name each one's field)."""
    return [load_image_url(value, param, allowed_local_media_path) if kind == "image_url"
            else check_image(value, param) for kind, value, param in sources]
