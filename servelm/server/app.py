"""The FastAPI application: routes only. Validation lives in protocol, the work in serving_*."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import servelm
from servelm.server import body_parse
from servelm.server.access import AccessMiddleware
from servelm.server.auth import OPEN_PATHS, APIKeyMiddleware
from servelm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from servelm.server.dashboard import BasicAsBearer, DashboardHub, install_dashboard
from servelm.server.errors import APIError, error_response, install_error_handlers
from servelm.server.openapi import (
    GENERATE,
    HEALTH,
    MODEL,
    PAGE,
    TOKENS,
    ChatCompletion,
    Completion,
    Detokenized,
    ResponseDeleted,
    ResponseItems,
    ResponseObject,
    Tokenized,
    Version,
    install_openapi,
)
from servelm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from servelm.server.protocol_responses import ResponsesRequest
from servelm.server.serving import ServerState
from servelm.server.serving_chat import ServingChat
from servelm.server.serving_completion import ServingCompletion
from servelm.server.serving_responses import ServingResponses


def build_app(
    state: ServerState,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    app = FastAPI(title="servelm", version=servelm.__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
        app.add_middleware(BasicAsBearer)  # outside the key check: the dashboard's browsers
    # outermost: 401s and 413s answered by the layers above get a request id, a count, a line
    app.add_middleware(AccessMiddleware, on_status=state.metrics.on_http_status)
    chat = ServingChat(state)
    completion = ServingCompletion(state)
    responses = ServingResponses(chat)
    tokenizer = state.engine.tokenizer
    app.state.servelm = state

    @app.get("/health", response_class=Response, responses=HEALTH)
    @app.get("/ping", response_class=Response, responses=HEALTH)
    @app.head("/health", include_in_schema=False)  # load balancers that probe with HEAD
    async def health() -> Response:
        if state.engine.is_alive:
            return Response(status_code=200)
        return error_response(503, f"engine is not running: {state.engine.dead_reason}")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=Version)
    async def version() -> dict:
        return {"version": servelm.__version__}

    def card() -> ModelCard:
        return ModelCard(
            id=state.model_name, root=str(state.engine.model_dir), max_model_len=state.max_model_len
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", responses=MODEL)
    async def model(model: str) -> ModelCard:
        chat.check_model(model)
        return card()

    @body_parse.post(app, "/v1/chat/completions", response_model=ChatCompletion, responses=GENERATE)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await chat.create(req, raw)

    @body_parse.post(app, "/v1/completions", response_model=Completion, responses=GENERATE)
    async def completions(req: CompletionRequest, raw: Request):
        return await completion.create(req, raw)

    @body_parse.post(app, "/v1/responses", response_model=ResponseObject, responses=GENERATE)
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=MODEL)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.get(response_id))

    @app.get(
        "/v1/responses/{response_id}/input_items", response_model=ResponseItems, responses=PAGE
    )
    async def response_input_items(
        response_id: str,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> JSONResponse:
        return JSONResponse(responses.input_items(response_id, limit, order, after))

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=MODEL)
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.delete(response_id))

    @body_parse.post(app, "/tokenize", response_model=Tokenized, responses=TOKENS)
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        chat.check_model(req.model)
        if req.messages is not None:  # counted as a chat completion would count them
            setup = chat.tool_setup(req)
            ids = await chat.encode_messages(
                req.messages, req.add_generation_prompt, setup, req.chat_template_kwargs
            )
        elif req.prompt is not None:
            ids = await chat.encode(req.prompt, req.add_special_tokens, bounded=False)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
        )

    @body_parse.post(app, "/detokenize", response_model=Detokenized, responses=TOKENS)
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        chat.check_model(req.model)
        chat.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    install_dashboard(app, DashboardHub(state.engine, state.metrics, state.model_name))
    install_openapi(app, bool(api_key), OPEN_PATHS, tokenizer.vocab_size)
    return app
