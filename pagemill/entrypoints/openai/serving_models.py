"""The served model names: /v1/models and the `model` field check (404 for an unknown name)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ModelCard, ModelList

if TYPE_CHECKING:
    from pagemill.entrypoints.openai.serving_lora import LoRAAdapters
    from pagemill.lora.request import LoRARequest


class OpenAIServingModels:
    """Names a client may use for the one model this server runs."""

    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int,
                 lora: LoRAAdapters | None = None, runner: str = "generate",
                 supported_tasks: tuple[str, ...] = ("generate",)) -> None:
        """`lora`: the served LoRA adapters, selectable by name too (None: the base model only); `runner` and
        `supported_tasks`: what the model does (reported in /v1/models)."""
        if not served_model_names:
            raise ValueError("served_model_name must name at least one model.")
        self.names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora = lora
        self.runner, self.supported_tasks = runner, list(supported_tasks)

    @property
    def default_name(self) -> str:
        """The name responses report."""
        return self.names[0]

    def resolve(self, name: str | None) -> str:
        """The name to report for a request's `model` field; raises a 404 for an unknown model."""
        if name is None or name == "":
            return self.default_name
        if name in self.names or self.lora_request(name) is not None:
            return name
        served = self.names + (self.lora.names if self.lora is not None else [])
        raise OpenAIError(f"The model `{name}` does not exist. Served models: {', '.join(served)}.",
                          404, "model")

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a `model` name selects (None: the base model)."""
        return self.lora.get(name) if self.lora is not None else None

    def list_models(self) -> ModelList:
        """The /v1/models response."""
        cards = [ModelCard(id=n, root=self.model_path, max_model_len=self.max_model_len, runner=self.runner,
                           supported_tasks=self.supported_tasks) for n in self.names]
        if self.lora is not None:
            cards += self.lora.cards(self.max_model_len)
        return ModelList(data=cards)
