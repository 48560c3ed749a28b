"""The OpenAI-compatible HTTP server: FastAPI app over an AsyncLLM, run by uvicorn (`pagemill serve`)."""

from __future__ import annotations

import argparse
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import pagemill
from pagemill.engine.async_llm import AsyncLLM
from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.anthropic.serving_messages import MESSAGES_PATHS, add_messages_routes, anthropic_error
from pagemill.entrypoints.chat_utils import ChatRenderer, ChatTemplateError, load_chat_template
from pagemill.entrypoints.openai.cancellation import with_cancellation
from pagemill.entrypoints.openai.errors import OpenAIError, error_body, from_validation_error
from pagemill.entrypoints.openai.cors import CORSOptions, add_cors
from pagemill.entrypoints.openai.lora_modules import LoRAModulePath, runtime_lora_updating_allowed
from pagemill.entrypoints.openai.openapi_docs import HealthResponse, document_api, error_responses
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  EmbeddingRequest, PoolingRequest, RerankRequest,
                                                  ScoreRequest, TokenizeRequest)
from pagemill.entrypoints.openai.serving_chat import OpenAIServingChat
from pagemill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagemill.entrypoints.openai.serving_engine import json_response
from pagemill.entrypoints.openai.serving_invocations import add_invocations_route
from pagemill.entrypoints.openai.serving_lora import LoRAAdapters, add_lora_routes
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.entrypoints.openai.serving_pooling import OpenAIServingEmbedding, check_generate_model
from pagemill.entrypoints.openai.serving_responses import add_responses_routes
from pagemill.entrypoints.openai.serving_score import OpenAIServingScore
from pagemill.entrypoints.openai.server_lifecycle import GracefulServer
from pagemill.entrypoints.openai.server_limits import BodySizeLimitMiddleware, ServerLimits
from pagemill.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagemill.entrypoints.openai.serving_tokenizer_files import add_tokenizer_routes
from pagemill.metrics.per_engine import PerEngineStatLogger
from pagemill.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("pagemill.entrypoints.openai.api_server")

# Paths anyone may call even when --api-key is set (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


class APIKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) matches one of the keys
    (pure ASGI, stream-safe)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.tokens = [f"Bearer {k}".encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not given and b"x-api-key" in headers:  # Anthropic's clients send the key this way
            given = b"Bearer " + headers[b"x-api-key"]
        if any(hmac.compare_digest(given, t) for t in self.tokens):
            await self.app(scope, receive, send)
            return
        message = "Missing API key: send 'Authorization: Bearer <key>'." if not given else "Incorrect API key."
        await JSONResponse(error_body(message, 401, "Authorization"), status_code=401)(scope, receive, send)


def _register_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ChatTemplateError)
    async def chat_template_error(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return OpenAIError(exc.message, 400, exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = from_validation_error(exc)
        if request.url.path in MESSAGES_PATHS:  # Anthropic's clients read Anthropic's error shape
            return anthropic_error(error.message, error.status)
        return error.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        status = getattr(exc, "status", 500)
        message = str(exc) if status != 500 else f"The engine is dead: {exc}"
        return JSONResponse(error_body(message, status), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=exc.headers)  # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return JSONResponse(error_body(f"Internal error: {type(exc).__name__}: {exc}", 500), status_code=500)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_keys: list[str] | None = None,
              chat_template: str | None = None, shutdown_engine: bool = True,
              auto_tool_parser: str | None = None, lora_modules: list[LoRAModulePath] | None = None,
              limits: ServerLimits | None = None, cors: CORSOptions | None = None,
              enable_tokenizer_info: bool = False, serve_tokenizer_files: bool = True) -> FastAPI:
    """The FastAPI app serving `engine` (with its own Prometheus registry, so several apps can coexist).

    `auto_tool_parser`: the tool-call parser of tool_choice="auto" (--enable-auto-tool-choice --tool-call-parser).
    `lora_modules`: LoRA adapters loaded at start-up (a bad one fails the start-up; the reason is left in
    app.state.startup_error). `limits`: what one request may cost (body size, request chat templates).
    `cors`: CORS headers for browsers (None: none). `enable_tokenizer_info`: GET /tokenizer_info (vLLM's
    --enable-tokenizer-info-endpoint); `serve_tokenizer_files`: the Hub file routes of serving_tokenizer_files.
    """
    limits = limits or ServerLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()  # notice the engine core's death even while idle
        try:
            await lora.load_static(lora_modules or [])
        except ValueError as e:
            app.state.startup_error = str(e)
            raise
        yield
        prompts.worker.shutdown()
        if shutdown_engine:
            logger.info("Shutting down the engine core.")
            engine.shutdown()

    app = FastAPI(title="pagemill", version=pagemill.__version__, lifespan=lifespan)
    mc = engine.model_config
    lora = LoRAAdapters(engine, served_model_names)
    tasks = ("generate",) if mc.pooler_config is None else mc.pooler_config.supported_tasks
    models = OpenAIServingModels(served_model_names, mc.model, mc.max_model_len, lora, mc.runner_type, tasks)
    prompts = PromptPreparer(engine.get_tokenizer(), ChatRenderer(engine.get_tokenizer(), chat_template),
                             mc.max_model_len, limits)
    reasoning_parser = engine.config.structured_outputs_config.reasoning_parser
    chat = OpenAIServingChat(engine, models, prompts, auto_tool_parser, reasoning_parser)
    completion = OpenAIServingCompletion(engine, models, prompts)
    tokenization = OpenAIServingTokenization(engine.get_tokenizer(), models, prompts)
    registry = CollectorRegistry()
    spec = engine.config.speculative_config
    num_spec = spec.num_speculative_tokens if spec is not None else None
    n = engine.num_engines
    # With data parallelism every series carries the `engine` label (vLLM's); the total is their sum.
    prometheus: PrometheusStatLogger | PerEngineStatLogger = (
        PrometheusStatLogger(registry, models.default_name, num_spec) if n == 1 else
        PerEngineStatLogger([PrometheusStatLogger(registry, models.default_name, num_spec, engine_index=i)
                             for i in range(n)]))
    kv_cache_config = getattr(engine.client, "kv_cache_config", None)
    if kv_cache_config is not None:
        prometheus.set_kv_capacity(kv_cache_config.usable_blocks)
    engine.stat_loggers.append(prometheus)
    engine.add_dead_callback(prometheus.mark_engine_dead)
    app.state.engine, app.state.registry, app.state.startup_error = engine, registry, None
    _register_error_handlers(app)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if cors is not None:
        add_cors(app, cors)

    @app.get("/health", response_model=HealthResponse, responses=error_responses(500))
    async def health() -> Response:
        """`{"status": "ok"}` while the engine core is alive; a 500 error once it died."""
        if not engine.is_running:
            return JSONResponse(error_body(f"The engine is not running: {engine.dead_error}", 500), status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/ping", response_model=HealthResponse, responses=error_responses(500))
    async def ping() -> Response:
        """Same as /health."""
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        """The pagemill version."""
        return JSONResponse({"version": pagemill.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics of this server."""
        return Response(prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        """The served model names."""
        return json_response(models.list_models())

    generates = mc.pooler_config is None  # the other runner's endpoints answer a 400 and are left out of the docs

    @app.post("/v1/completions", include_in_schema=generates)
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        """OpenAI legacy completions."""
        check_generate_model(engine, "/v1/completions")
        return await completion.create_completion(request)

    @app.post("/v1/chat/completions", include_in_schema=generates)
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        """OpenAI chat completions."""
        check_generate_model(engine, "/v1/chat/completions")
        return await chat.create_chat_completion(request)

    add_pooling_routes(app, engine, models, prompts)
    add_responses_routes(app, engine, models, prompts, auto_tool_parser=auto_tool_parser,
                         reasoning_parser=reasoning_parser)
    if generates:
        add_messages_routes(app, chat)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Drop the cached prefixes (only possible while idle)."""
        return JSONResponse({"success": await engine.reset_prefix_cache()})

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        """Token ids of a prompt or of chat messages."""
        return json_response(await tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        """Text of token ids."""
        return json_response(await tokenization.detokenize(request))

    if runtime_lora_updating_allowed():
        logger.warning("Runtime LoRA updating is allowed: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                       "load adapters from any path the server can read.")
        add_lora_routes(app, lora)
    add_invocations_route(app, engine, chat, completion, OpenAIServingEmbedding(engine, models, prompts))
    add_tokenizer_routes(app, engine.get_tokenizer(), served_model_names, chat_template, enable_tokenizer_info,
                         serve_tokenizer_files)
    document_api(app, OPEN_PATHS)
    return app


def add_pooling_routes(app: FastAPI, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer) -> None:
    """/v1/embeddings, /pooling, /score and /rerank (a 400 on a model that generates text)."""
    embedding = OpenAIServingEmbedding(engine, models, prompts)
    scoring = OpenAIServingScore(engine, models, prompts)
    pools = engine.model_config.pooler_config is not None  # else left out of the docs (they answer a 400)

    @app.post("/v1/embeddings", include_in_schema=pools)
    @with_cancellation
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        """OpenAI embeddings."""
        return await embedding.create_embedding(request)

    @app.post("/pooling", include_in_schema=pools)
    @with_cancellation
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        """The pooler's output of each input (vLLM)."""
        return await embedding.create_pooling(request)

    @app.post("/score", include_in_schema=pools)
    @app.post("/v1/score", include_in_schema=pools)
    @with_cancellation
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        """Scores of text pairs (vLLM)."""
        return await scoring.create_score(request)

    @app.post("/rerank", include_in_schema=pools)
    @app.post("/v1/rerank", include_in_schema=pools)
    @app.post("/v2/rerank", include_in_schema=pools)
    @with_cancellation
    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        """Documents ranked by relevance to a query (Jina / Cohere style, as vLLM)."""
        return await scoring.rerank(request)


def run_server(args: argparse.Namespace) -> None:
    """`pagemill serve`: start the engine core process, then serve HTTP until SIGINT/SIGTERM."""
    import uvicorn

    from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace, served_model_names
    from pagemill.entrypoints.openai.lora_modules import check_lora_modules

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    chat_template = load_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("pagemill serve: --enable-auto-tool-choice needs --tool-call-parser.")
    auto_tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    engine_args = engine_args_from_namespace(args)
    names = served_model_names(args)
    engine_args.served_model_name = names[0]
    lora_modules = args.lora_modules or []
    check_lora_modules(lora_modules, names, engine_args.enable_lora)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        limits = ServerLimits.from_args(args)
        app = build_app(engine, names, args.api_key, chat_template, auto_tool_parser=auto_tool_parser,
                        lora_modules=lora_modules, limits=limits, cors=CORSOptions.from_args(args),
                        enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
                        serve_tokenizer_files=args.serve_tokenizer_files)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log)
        logger.info("Serving %s on http://%s:%d", ", ".join(names), args.host, args.port)
        server = GracefulServer(config, engine, limits.shutdown_timeout_s)
        try:
            server.run()
        except SystemExit:  # uvicorn's exit on a failed start-up (lifespan or bind): said below, in one line
            if server.started:
                raise
    finally:
        engine.shutdown()
    if not server.started and app.state.startup_error:
        raise SystemExit(f"pagemill serve: {app.state.startup_error}")
    if not server.started:
        raise SystemExit(f"pagemill serve: the HTTP server could not start on {args.host}:{args.port}.")
    if server.exit_code:
        raise SystemExit(f"pagemill serve: the engine core died ({engine.dead_error}); exiting with code "
                         f"{server.exit_code} so that a supervisor can restart the server.")
