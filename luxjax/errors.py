"""Errors a client caused. The HTTP layer turns each into the OpenAI error shape with its status."""
from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as sent: status 4xx, OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ImageInputError(RequestError):
    """A problem with one image of a request (or with the images taken together)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_image", param: str | None = "messages"):
        super().__init__(message, status=status, code=code, param=param)


class ModelFormatError(ValueError):
    """A checkpoint/GGUF/projector that luxjax refuses to load, with what was found."""
