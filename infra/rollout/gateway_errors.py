"""The gateway's refusal, shared by its wire formats (:mod:`infra.rollout.gateway`, ``wire_*``)."""


class GatewayError(Exception):
    """A request refused: HTTP ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": type_, "param": param,
                                                    "code": code}}


def invalid_request(err: Exception) -> GatewayError:
    """A body that failed validation (pydantic, vLLM's protocol) as a 400 naming the field.

    pydantic's shallowest error names its location; a vLLM validation error its ``parameter``.
    """
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        first = min(err.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(p) for p in first["loc"])
        return GatewayError(400, f"invalid request: {where}: {first['msg']}", param=where)
    return GatewayError(400, f"invalid request: {err}", param=getattr(err, "parameter", None))
