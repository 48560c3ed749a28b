"""The served model names: /v1/models and the `model` field check (404 for an unknown name)."""

from __future__ import annotations

from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """Names a client may use for the one model this server runs."""

    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int,
                 runner: str = "generate", supported_tasks: tuple[str, ...] = ("generate",)) -> None:
        if not served_model_names:
            raise ValueError("served_model_name must name at least one model.")
        self.names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.runner, self.supported_tasks = runner, list(supported_tasks)

    @property
    def default_name(self) -> str:
        """The name responses report."""
        return self.names[0]

    def resolve(self, name: str | None) -> str:
        """The name to report for a request's `model` field; raises a 404 for an unknown model."""
        if name is None or name == "":
            return self.default_name
        if name in self.names:
            return name
        raise OpenAIError(f"The model `{name}` does not exist. Served models: {', '.join(self.names)}.",
                          404, "model")

    def list_models(self) -> ModelList:
        """The /v1/models response."""
        return ModelList(data=[ModelCard(id=n, root=self.model_path, max_model_len=self.max_model_len,
                                         runner=self.runner, supported_tasks=self.supported_tasks)
                               for n in self.names])
