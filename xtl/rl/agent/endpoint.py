"""An OpenAI-compatible chat-completions endpoint served from the rollout engine, for black-box agents.

:class:`SessionServer` listens on a local port (``POST /v1/chat/completions``, ``GET /v1/models``). An agent is
told the base URL and a session key as its API key; each request is recorded in that key's
:class:`~xtl.rl.agent.session.Session`. Requests wait in a queue; the trainer's thread takes them in batches
(:meth:`SessionServer.take`) and answers them (:meth:`SessionServer.answer`) with what the engine sampled, so every
forward runs on the trainer's thread and concurrent agents share one engine call. Sampling follows the run's
``sampling`` settings (the policy's temperature, top-p and per-turn budget); a request's own sampling fields are
ignored. Replies carry the content and the tool calls parsed from the template's syntax (``finish_reason:
tool_calls``); ``stream: true`` gets the same reply as server-sent events.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from xtl.rl.agent.chat import ChatFormat
from xtl.rl.agent.session import Session
from xtl.rl.rollout import Rollout

MODEL_NAME = "xtl-policy"
_POLL_S = 0.01  # how often a waiting batch re-reads how many requests it expects


@dataclass
class PendingRequest:
    """A request waiting for the engine.

    Attributes:
        session: Its session.
        prompt_ids: What the engine continues.
        arrived: When it arrived (``time.monotonic``).
    """

    session: Session
    prompt_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    rollout: Rollout | None = None


class SessionServer:
    """The endpoint (module docstring).

    Args:
        chat: The run's chat format.
        host: The address to listen on.
        port: The port (0: a free one).
        request_timeout_s: How long a request waits for the engine before it gets a 503.
    """

    def __init__(self, chat: ChatFormat, host: str = "127.0.0.1", port: int = 0, request_timeout_s: float = 600.0):
        self.chat = chat
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, Session] = {}
        self.queue: queue.Queue[PendingRequest] = queue.Queue()
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        self._http = ThreadingHTTPServer((host, port), _handler_for(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="xtl-agent-endpoint", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def open(self, key: str) -> Session:
        """A new session for ``key``."""
        with self._lock:
            session = self.sessions[key] = Session(key, self.chat)
        return session

    def close(self, key: str) -> None:
        """Forget ``key``'s session (later requests with it are refused)."""
        with self._lock:
            self.sessions.pop(key, None)

    def take(self, expected: Callable[[], int], wait_s: float) -> list[PendingRequest]:
        """The requests to sample now: wait until ``expected()`` (re-read as agents come and go: the live agents)
        are queued, or ``wait_s`` passed."""
        batch: list[PendingRequest] = []
        deadline = time.monotonic() + wait_s
        while len(batch) < expected() and time.monotonic() < deadline:
            try:
                batch.append(self.queue.get(timeout=min(_POLL_S, max(deadline - time.monotonic(), 0.0))))
            except queue.Empty:
                continue
        while True:  # whatever else is already queued joins the batch
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                return batch

    def answer(self, request: PendingRequest, rollout: Rollout) -> None:
        """Give ``request`` its sampled ids (its handler replies)."""
        request.rollout = rollout
        request.done.set()

    def shutdown(self) -> None:
        """Stop listening."""
        self._http.shutdown()
        self._http.server_close()

    # ---- the handler's side (HTTP threads) -------------------------------------------------------------------

    def complete(self, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Serve one chat-completions request body for session ``key``: ``(status, JSON reply)``."""
        with self._lock:
            session = self.sessions.get(key)
            if session is None:
                return HTTPStatus.UNAUTHORIZED, _error("unknown or closed session key", "invalid_api_key")
            if key in self._busy:
                return HTTPStatus.CONFLICT, _error("this session already has a request in flight", "conflict")
            self._busy.add(key)
        try:
            messages, tools = body.get("messages"), body.get("tools")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                return HTTPStatus.BAD_REQUEST, _error("'messages' must be a non-empty list of message objects")
            try:
                prompt = session.prompt(messages, tools)
            except Exception as err:  # the template refuses the conversation: the agent gets why
                return HTTPStatus.BAD_REQUEST, _error(f"cannot render the conversation: {err}")
            request = PendingRequest(session, prompt)
            self.queue.put(request)
            if not request.done.wait(self.request_timeout_s) or request.rollout is None:
                return HTTPStatus.SERVICE_UNAVAILABLE, _error("the engine did not answer in time", "timeout")
            parsed, message = session.reply(request.rollout)
            return HTTPStatus.OK, _completion(key, session.requests, request, message, parsed.calls)
        finally:
            with self._lock:
                self._busy.discard(key)


# ---- private ---------------------------------------------------------------------------------------------------


def _completion(
    key: str, number: int, request: PendingRequest, message: dict[str, Any], calls: list[dict[str, Any]]
) -> dict[str, Any]:
    rollout = request.rollout
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if calls:
        reply["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in calls
        ]  # fmt: skip
    finish = "tool_calls" if calls else ("length" if rollout.finish_reason == "length" else "stop")
    return {
        "id": f"chatcmpl-{key}-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(rollout.prompt_ids),
            "completion_tokens": len(rollout.response_ids),
            "total_tokens": len(rollout.prompt_ids) + len(rollout.response_ids),
        },
    }


def _chunks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion as streaming chunks: the whole message as one delta, then the finish reason."""
    choice = reply["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": MODEL_NAME}
    return [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
         "usage": reply["usage"]},
    ]  # fmt: skip


def _error(message: str, code: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": code, "code": code}}


def _handler_for(server: SessionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/").endswith("/models"):
                self._send(HTTPStatus.OK, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
            else:
                self._send(HTTPStatus.NOT_FOUND, _error(f"no route {self.path}", "not_found"))

        def do_POST(self) -> None:  # noqa: N802
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._send(HTTPStatus.NOT_FOUND, _error(f"no route {self.path}", "not_found"))
                return
            key = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except (ValueError, json.JSONDecodeError):
                self._send(HTTPStatus.BAD_REQUEST, _error("the body is not JSON"))
                return
            status, reply = server.complete(key, body if isinstance(body, dict) else {})
            if status == HTTPStatus.OK and body.get("stream"):
                self._stream(reply)
            else:
                self._send(status, reply)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per request
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, reply: dict[str, Any]) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in _chunks(reply):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler
