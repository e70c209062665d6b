"""GET /v1/models, GET /v1/models/{model}."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_server.errors import api_endpoint, model_not_found


@api_endpoint
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


@api_endpoint
async def retrieve_model(request: Request) -> Response:
    model = request.path_params["model"]
    if model != request.app.state.engine.model_id:
        raise model_not_found(model)
    return JSONResponse(_model_card(request))


def _model_card(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    return {
        "id": engine.model_id,
        "object": "model",
        "created": request.app.state.started_at,
        "owned_by": "qml",
        # Extras beyond OpenAI's card; clients read max_model_len to size prompts.
        "max_model_len": engine.context_length,
        "info": _public_info(engine.info()),
    }


# What of engine.info() clients may see. An allowlist, because info() also carries
# things like the model's path on the server's disk, which is nobody's business.
_PUBLIC_INFO = ("architecture", "parameters", "quant_types", "dtype", "device", "context_length", "vocab_size")


def _public_info(info: dict[str, Any]) -> dict[str, Any]:
    return {k: _json_safe(info[k]) for k in _PUBLIC_INFO if k in info}


def _json_safe(value: Any) -> Any:
    # info() may hold a torch.device or dtype; render anything exotic as text.
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
