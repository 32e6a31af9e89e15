"""The gateway's refusal, shared by its wire formats (:mod:`infra.rollout.gateway`, ``wire_*``)."""


class GatewayError(Exception):
    """A request refused: HTTP ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": type_, "param": param,
                                                    "code": code}}
