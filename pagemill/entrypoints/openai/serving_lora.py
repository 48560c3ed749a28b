"""The server's LoRA adapters by name (what the `model` field selects and /v1/models lists), and vLLM's runtime
routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

import asyncio
import itertools
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from pagemill.engine.async_llm import AsyncLLM
from pagemill.entrypoints.openai.errors import OpenAIError, from_value_error
from pagemill.entrypoints.openai.lora_modules import LoRAModulePath
from pagemill.entrypoints.openai.protocol import ModelCard, OpenAIBaseModel
from pagemill.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter already served under this name


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter: stop serving an adapter, named or by id."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class LoRAAdapters:
    """The adapters a server serves, by name; the engine loads and checks each one before it is served."""

    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = list(base_names)
        self.requests: dict[str, LoRARequest] = {}
        # Ids are never reused: the prefix cache and in-flight requests key an adapter's weights by its id.
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as `name`, if any."""
        return self.requests.get(name) if name else None

    @property
    def names(self) -> list[str]:
        """The served adapter names, in load order."""
        return list(self.requests)

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """The /v1/models entries of the adapters (vLLM's: root = path, parent = base model name)."""
        return [ModelCard(id=r.lora_name, root=r.lora_path, parent=r.base_model_name or self.base_names[0],
                          max_model_len=max_model_len) for r in self.requests.values()]

    async def load(self, name: str, path: str, base_model_name: str | None = None,
                   load_inplace: bool = False) -> LoRARequest:
        """Load and check an adapter in the engine, then serve it as `name`; OpenAIError 400 naming the field."""
        if not name:
            raise OpenAIError("lora_name must not be empty.", 400, "lora_name")
        if not path:
            raise OpenAIError("lora_path must not be empty.", 400, "lora_path")
        if self.engine.config.lora_config is None:
            raise OpenAIError("LoRA adapters are disabled: start the server with --enable-lora.", 400, "lora_name")
        if name in self.base_names:
            raise OpenAIError(f"lora_name {name!r} is the name of the served base model.", 400, "lora_name")
        async with self._lock:
            old = self.requests.get(name)
            if old is not None and not load_inplace:
                raise OpenAIError(f"The LoRA adapter {name!r} is already loaded (from {old.lora_path}); unload it "
                                  "first or set load_inplace to true.", 400, "lora_name")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await self.engine.add_lora(request)
            except ValueError as e:
                err = from_value_error(e, ("lora_name", "lora_path"), "lora_path")
                err.message = f"Cannot load LoRA adapter {name!r}: {err.message}"
                raise err from None
            self.requests[name] = request
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)
        logger.info("Serving LoRA adapter %r (id %d) from %s", name, request.lora_int_id, path)
        return request

    async def unload(self, name: str | None = None, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving an adapter (requests already running with it finish with it); 404 if it is not served."""
        if not name and lora_int_id is None:
            raise OpenAIError("Give lora_name (or lora_int_id) of the adapter to unload.", 400, "lora_name")
        async with self._lock:
            request = self._find(name, lora_int_id)
            del self.requests[request.lora_name]
            await self.engine.remove_lora(request.lora_int_id)
        logger.info("Unloaded LoRA adapter %r (id %d)", request.lora_name, request.lora_int_id)
        return request

    def _find(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        if name:
            request = self.requests.get(name)
            if request is None:
                raise OpenAIError(f"The LoRA adapter {name!r} cannot be found.", 404, "lora_name")
            if lora_int_id is not None and request.lora_int_id != lora_int_id:
                raise OpenAIError(f"lora_int_id {lora_int_id} is not the id of adapter {name!r} "
                                  f"({request.lora_int_id}).", 400, "lora_int_id")
            return request
        found = next((r for r in self.requests.values() if r.lora_int_id == lora_int_id), None)
        if found is None:
            raise OpenAIError(f"No LoRA adapter has lora_int_id {lora_int_id}.", 404, "lora_int_id")
        return found

    async def load_static(self, modules: list[LoRAModulePath]) -> None:
        """Load the --lora-modules adapters at start-up; ValueError naming the first that fails."""
        for m in modules:
            try:
                await self.load(m.name, m.path, m.base_model_name)
            except OpenAIError as e:
                named = e.message if repr(m.name) in e.message else f"adapter {m.name!r}: {e.message}"
                raise ValueError(f"--lora-modules: {named}") from None


def add_lora_routes(app: FastAPI, adapters: LoRAAdapters) -> None:
    """Add vLLM's runtime adapter routes (only when runtime LoRA updating is allowed)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        """Serve a PEFT adapter under a new model name."""
        lora = await adapters.load(request.lora_name, request.lora_path, load_inplace=request.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter."""
        lora = await adapters.unload(request.lora_name, request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")
