"""A bound on the size of a request's head (request line and headers), in front of httptools.

uvicorn's httptools protocol (its default, and its fastest) takes headers of any size: httptools
grows a buffer for a header value until its line ends, so six connections each sending a 32 MB
header value grew the server by 288 MB. HeadLimitedHttpTools counts the bytes of each request's
head as they arrive and, past MAX_HEAD_BYTES, answers 431 (Request Header Fields Too Large) and
closes the connection before httptools sees more: what one connection can make the server hold
is MAX_HEAD_BYTES. (uvicorn's h11 protocol has such a limit, `h11_max_incomplete_event_size`, but
answers 400 and parses in Python: a /tokenize round trip 0.82-0.85 ms against 0.72: docs/serving.md.)
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024  # h11's default is 16 KiB, nginx's 32 KiB (4 x 8 KiB), Node's 16 KiB
TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class HeadLimitedHttpTools(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol with MAX_HEAD_BYTES per request head (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # bytes of the current request's head so far; None: complete

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None or self._head_bytes + len(data) <= MAX_HEAD_BYTES:
            if self._head_bytes is not None:
                self._head_bytes += len(data)
            super().data_received(data)
            return
        room = MAX_HEAD_BYTES - self._head_bytes  # the head must end within these bytes
        self._head_bytes = MAX_HEAD_BYTES
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._head_bytes is not None:  # still in the head: too large
            self._refuse()
            return
        self.data_received(data[room:])  # the body (or a next request, counted anew)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # a pipelined request's head may follow

    def _refuse(self) -> None:
        message = f"request head exceeds {MAX_HEAD_BYTES} bytes (request line and headers)".encode()
        self.logger.warning("refused a request whose head exceeds %d bytes (431)", MAX_HEAD_BYTES)
        self.transport.write(TOO_LARGE % (len(message), message))
        self.transport.close()
