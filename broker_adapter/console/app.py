"""The console's pages and actions (Starlette; pages rendered by Jinja2 with autoescape).

Every route but the login page needs an operator (``auth.Tokens``): without one a page
answers 401 and shows nothing else. Actions are POSTs; a browser session's carry its CSRF
token (``auth.Csrf``), a read-only token's get 403. Each decision calls the function the
CLI command calls (``app.effects_cli``, ``app.commands``, ``app.ops``) and records the
operator's name (``who``); each is logged on ``broker_adapter.console``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from broker_adapter.app.commands import cancel_task
from broker_adapter.app.effects_cli import (
    approval_store,
    grant_approval,
    resolve_unknown,
    what_a_task_waits_for,
)
from broker_adapter.app.ops import replay_dead_letter
from broker_adapter.console.auth import COOKIE, Csrf, Operator, Tokens
from broker_adapter.console.sources import Store, dead_letters, shown
from broker_adapter.errors import BrokerAdapterError, ConfigError
from broker_adapter.store import OutboxStore
from broker_adapter.store import console_queries as q
from broker_adapter.store.report import LIVE_NAMES

log = logging.getLogger("broker_adapter.console")

#: Seconds between the pipeline page's refreshes (``<meta http-equiv="refresh">``).
REFRESH_S: Final = 5

#: An approval granted from the console lasts this long unless the form says otherwise.
DEFAULT_APPROVAL_S: Final = 3600.0

#: What every answer carries: no script runs, nothing is framed, nothing is cached.
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass
class ConsoleConfig:
    """What the console serves: ``stores`` (at least one), the Redis ``client`` holding
    the dead-letter streams under ``prefix``, and who may look (``tokens``)."""

    stores: list[Store]
    client: Any
    prefix: str
    tokens: Tokens
    csrf: Csrf = field(default_factory=Csrf)
    refresh_s: int = REFRESH_S
    now: Callable[[], float] = time.time


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def create_app(config: ConsoleConfig) -> Starlette:
    """The console as an ASGI application."""
    if not config.stores:
        raise ValueError("the console needs at least one store")
    env = Environment(loader=PackageLoader("broker_adapter.console", "templates"), autoescape=True)
    env.globals.update(shown=shown, when=_when, age=_age_text, live_states=LIVE_NAMES)
    env.filters["qs"] = lambda d: urlencode({k: v for k, v in d.items() if v not in (None, "")})
    console = _Console(config, env)
    routes = [
        Route("/login", console.login_page, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.action(console.logout), methods=["POST"]),
        Route("/", console.page(console.pipeline), methods=["GET"]),
        Route("/tasks", console.page(console.tasks), methods=["GET"]),
        Route("/tasks/{task_id:path}", console.page(console.task), methods=["GET"]),
        Route("/decisions", console.page(console.decisions), methods=["GET"]),
        Route("/dead-letters", console.page(console.dead_letters), methods=["GET"]),
        Route("/actions/approve", console.action(console.approve), methods=["POST"]),
        Route("/actions/deny", console.action(console.deny), methods=["POST"]),
        Route("/actions/reconcile", console.action(console.reconcile), methods=["POST"]),
        Route("/actions/cancel", console.action(console.cancel), methods=["POST"]),
        Route("/actions/replay", console.action(console.replay), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _when(at: Any) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(at))) + " UTC"


def _age_text(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


PageHandler = Callable[[Request, Operator, "_Ctx"], Awaitable[Response]]


@dataclass(frozen=True)
class _Ctx:
    """A request's session: its token (for the CSRF token), the chosen store's index."""

    token: str
    index: int
    store: Store


class _Console:
    def __init__(self, config: ConsoleConfig, env: Environment) -> None:
        self.config = config
        self.env = env

    # -- rendering and authentication -------------------------------------------------------

    def render(
        self,
        name: str,
        status: int = 200,
        ctx: _Ctx | None = None,
        operator: Operator | None = None,
        **values: Any,
    ) -> HTMLResponse:
        values.update(
            operator=operator,
            stores=self.config.stores,
            db=None if ctx is None else ctx.index,
            csrf=None if ctx is None else self.config.csrf.token_for(ctx.token),
        )
        html = self.env.get_template(name).render(**values)
        return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)

    def unauthorized(self) -> HTMLResponse:
        response = self.render(
            "message.html",
            401,
            title="Not signed in",
            message="This page needs an operator token.",
            login=True,
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="broker-adapter console"'
        return response

    def _session(self, request: Request) -> tuple[str, Operator, bool] | None:
        """The presented token, its operator and whether it came in the header."""
        header = request.headers.get("authorization", "")
        if header:
            scheme, _, token = header.partition(" ")
            operator = (
                self.config.tokens.find(token.strip()) if scheme.lower() == "bearer" else None
            )
            return None if operator is None else (token.strip(), operator, True)
        cookie = request.cookies.get(COOKIE)
        operator = self.config.tokens.find(cookie)
        return None if operator is None or cookie is None else (cookie, operator, False)

    def _ctx(self, request: Request, token: str, raw: Any) -> _Ctx:
        try:
            index = int(raw or 0)
        except ValueError:
            index = -1
        if not 0 <= index < len(self.config.stores):
            raise _Refused(404, f"no store number {str(raw)[:40]!r}")
        return _Ctx(token, index, self.config.stores[index])

    def page(self, handler: PageHandler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = self._session(request)
            if session is None:
                return self.unauthorized()
            token, operator, _ = session
            try:
                ctx = self._ctx(request, token, request.query_params.get("db"))
                return await handler(request, operator, ctx)
            except _Refused as exc:
                return self.render(
                    "message.html", exc.status, operator=operator, title="Refused", message=str(exc)
                )
            except BrokerAdapterError as exc:  # the store or Redis not answering now
                log.warning("console: %s: %s", request.url.path, exc)
                return self.render(
                    "message.html", 503, operator=operator, title="Not answering", message=str(exc)
                )

        return endpoint

    def action(self, handler: PageHandler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = self._session(request)
            if session is None:
                return self.unauthorized()
            token, operator, by_header = session
            if operator.read_only:
                return self.render(
                    "message.html",
                    403,
                    operator=operator,
                    title="Refused",
                    message="This token may look but not act.",
                )
            form = await request.form()
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            # A browser sends the cookie on its own, never the Authorization header: only
            # a cookie session needs the form's CSRF token.
            if not by_header and not self.config.csrf.check(token, fields.get("csrf")):
                return self.render(
                    "message.html",
                    403,
                    operator=operator,
                    title="Refused",
                    message="The form is stale or not this session's: load the page again.",
                )
            try:
                ctx = self._ctx(request, token, fields.get("db"))
                request.state.fields = fields
                return await handler(request, operator, ctx)
            except _Refused as exc:
                return self.render(
                    "message.html", exc.status, operator=operator, title="Refused", message=str(exc)
                )
            except (BrokerAdapterError, ValueError, KeyError) as exc:
                return self.render(
                    "message.html", 409, operator=operator, title="Not done", message=str(exc)
                )

        return endpoint

    # -- login ------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        return self.render("login.html")

    async def login(self, request: Request) -> Response:
        form = await request.form()
        token = form.get("token")
        token = token.strip() if isinstance(token, str) else ""
        if self.config.tokens.find(token) is None:
            return self.render("login.html", 401, error="That is not an operator token.")
        response = RedirectResponse("/", status_code=303, headers=SECURITY_HEADERS)
        response.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="strict",
            path="/",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        response = RedirectResponse("/login", status_code=303, headers=SECURITY_HEADERS)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    # -- pages ------------------------------------------------------------------------------

    async def pipeline(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        now = self.config.now()
        group = request.query_params.get("group") or q.PIPELINE_GROUPS[0]
        if group not in q.PIPELINE_GROUPS:
            raise _Refused(400, f"the pipeline groups by one of {', '.join(q.PIPELINE_GROUPS)}")
        view = await run_in_threadpool(q.pipeline, ctx.store.db, now, group)
        letters, by_reason = await self._letters()
        return self.render(
            "pipeline.html",
            ctx=ctx,
            operator=operator,
            view=view,
            group=group,
            groups=q.PIPELINE_GROUPS,
            by_reason=by_reason,
            letters=len(letters),
            refresh=self.config.refresh_s,
        )

    async def _letters(self) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        try:
            return await run_in_threadpool(dead_letters, self.config.client, self.config.prefix)
        except BrokerAdapterError as exc:  # Redis away: the database's part still shows
            log.warning("dead letters not read: %s", exc)
            return [], None

    async def tasks(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        p = request.query_params
        search = {
            k: (p.get(k) or "").strip() or None
            for k in ("task_id", "message_id", "principal", "state")
        }
        try:
            rows = await run_in_threadpool(
                lambda: q.search_tasks(
                    ctx.store.db,
                    task_id=search["task_id"],
                    message_id=search["message_id"],
                    principal=search["principal"],
                    state=search["state"],
                )
            )
        except ValueError as exc:
            raise _Refused(400, str(exc)) from None
        return self.render(
            "tasks.html", ctx=ctx, operator=operator, rows=rows, search=search, states=q.TASK_STATES
        )

    async def task(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        task_id = request.path_params["task_id"]
        story = await run_in_threadpool(q.task_story, ctx.store.db, task_id)
        if story is None:
            raise _Refused(404, f"no task {task_id!r} in {ctx.store.label}")
        return self.render(
            "task.html", ctx=ctx, operator=operator, s=story, note=request.query_params.get("note")
        )

    async def decisions(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        waits = await run_in_threadpool(q.waiting_approvals, ctx.store.db)
        unknown = await run_in_threadpool(q.unknown_outcomes, ctx.store.db)
        return self.render(
            "decisions.html",
            ctx=ctx,
            operator=operator,
            waits=waits,
            unknown=unknown,
            default_s=int(DEFAULT_APPROVAL_S),
            note=request.query_params.get("note"),
        )

    async def dead_letters(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        letters, by_reason = await self._letters()
        replies = await run_in_threadpool(q.dead_replies, ctx.store.db)
        return self.render(
            "dead_letters.html",
            ctx=ctx,
            operator=operator,
            letters=letters,
            by_reason=by_reason,
            replies=replies,
            note=request.query_params.get("note"),
        )

    # -- actions ----------------------------------------------------------------------------

    def _done(self, ctx: _Ctx, path: str, note: str) -> Response:
        query = urlencode({"db": ctx.index, "note": note})
        return RedirectResponse(f"{path}?{query}", status_code=303, headers=SECURITY_HEADERS)

    @staticmethod
    def _who(operator: Operator) -> str:
        return f"{operator.name} (console)"

    @staticmethod
    def _field(request: Request, name: str, default: str | None = None) -> str:
        value = request.state.fields.get(name, default)
        if value is None or not str(value).strip():
            raise _Refused(400, f"the form has no {name}")
        return str(value).strip()

    async def approve(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        task_id = self._field(request, "task_id")
        try:
            expires_in = float(self._field(request, "expires_in", str(DEFAULT_APPROVAL_S)))
        except ValueError:
            raise _Refused(400, "expires_in must be a number of seconds") from None
        story = await run_in_threadpool(q.task_story, ctx.store.db, task_id)
        wait = None if story is None else story["approval_wait"]
        if wait is None or story is None or story["task"]["state"] != "waiting_approval":
            raise _Refused(409, f"task {task_id!r} is not waiting for an approval")
        who = self._who(operator)

        def approve() -> str:
            what = what_a_task_waits_for(approval_store(ctx.store.db), task_id)
            return grant_approval(ctx.store.db, what, who, expires_in)

        try:
            approval_id = await run_in_threadpool(approve)
        except ConfigError as exc:
            raise _Refused(409, str(exc)) from None
        log.info(
            "console: %s approved %s on %s (%s) for task %s: %s",
            who,
            wait["action"],
            wait["target"],
            wait["scope"],
            task_id,
            approval_id,
        )
        return self._done(ctx, f"/tasks/{task_id}", f"approved by {operator.name}")

    async def deny(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        task_id = self._field(request, "task_id")
        reason = request.state.fields.get("reason", "").strip() or "no reason given"
        who = self._who(operator)
        story = await run_in_threadpool(q.task_story, ctx.store.db, task_id)
        if story is None or story["task"]["state"] != "waiting_approval":
            raise _Refused(409, f"task {task_id!r} is not waiting for an approval")
        out = await run_in_threadpool(
            cancel_task, ctx.store.db, task_id, f"approval denied: {reason}", who
        )
        log.info("console: %s denied the approval of task %s: %s", who, task_id, out)
        return self._done(ctx, f"/tasks/{task_id}", f"denied by {operator.name}")

    async def reconcile(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        task_id = self._field(request, "task_id")
        answer = self._field(request, "outcome")
        if answer not in ("done", "not-done"):
            raise _Refused(400, "outcome is done or not-done")
        outcome: Literal["done", "not-done"] = "done" if answer == "done" else "not-done"
        result = request.state.fields.get("result", "").strip() or "null"
        note = request.state.fields.get("note", "").strip() or None
        who = self._who(operator)
        state = await run_in_threadpool(
            lambda: resolve_unknown(
                ctx.store.db,
                task_id,
                outcome,
                who,
                result=result,
                note=note,
            )
        )
        log.info("console: %s answered %s for task %s: %s", who, outcome, task_id, state.value)
        return self._done(ctx, f"/tasks/{task_id}", f"answered {outcome} by {operator.name}")

    async def cancel(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        task_id = self._field(request, "task_id")
        reason = request.state.fields.get("reason", "").strip() or "no reason given"
        who = self._who(operator)
        out = await run_in_threadpool(cancel_task, ctx.store.db, task_id, reason, who)
        log.info("console: %s cancelled task %s: %s", who, task_id, out)
        return self._done(ctx, f"/tasks/{task_id}", f"cancel: {out['state']}")

    async def replay(self, request: Request, operator: Operator, ctx: _Ctx) -> Response:
        item_id = self._field(request, "id")
        who = self._who(operator)
        outbox = OutboxStore(ctx.store.db)
        out = await run_in_threadpool(
            replay_dead_letter, outbox, self.config.client, self.config.prefix, item_id, who
        )
        log.info("console: %s replayed %s: %s", who, item_id, out)
        what = out.get("outcome") or f"back on {out.get('replayed_to')}"
        return self._done(ctx, "/dead-letters", f"replayed {item_id}: {what}")
