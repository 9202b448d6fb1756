"""The dashboard's web app: JSON over the run registry, groups of runs (sweeps), runs compared
side by side, evals and endpoints, and the page.

Read-only by construction: every route is a GET that reads the palaestra home, through the run
store (``palaestra.runs``), which owns every file format it shows. The page is
one static HTML file whose script (served from this package, no CDN) fetches the JSON and
polls it while a run is live, so no template engine or JavaScript build step is involved.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from palaestra.home import palaestra_home
from palaestra.runs import groups, records
from palaestra.runs.compare import compare_runs
from palaestra.runs.endpoints import list_endpoints
from palaestra.runs.evals import list_evals, read_eval
from palaestra.runs.registry import open_run

STATIC = Path(__file__).parent / "static"
NO_STORE = {"Cache-Control": "no-store"}  # live data: never answer a poll from a cache


def create_app(home: Path | None = None) -> FastAPI:
    """The dashboard over ``home`` (default: the palaestra home at request time)."""
    app = FastAPI(title="palaestra dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def where() -> Path:
        return home or palaestra_home()

    def found(read, *args: Any) -> Any:
        try:
            return read(*args, home=where())
        except KeyError as error:
            raise HTTPException(status_code=404, detail=str(error.args[0])) from None

    @app.get("/", include_in_schema=False)
    @app.get("/runs/{run_id}", include_in_schema=False)
    @app.get("/groups/{group_id}", include_in_schema=False)
    @app.get("/compare", include_in_schema=False)
    def page(run_id: str | None = None, group_id: str | None = None) -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=NO_STORE)

    @app.get("/api/home")
    def home_info() -> dict[str, str]:
        return {"home": str(where())}

    @app.get("/api/runs")
    def runs(status: str | None = None, limit: int | None = Query(None, ge=1)) -> Any:
        return _json(records.list_runs(where(), status=status or None, limit=limit))

    @app.get("/api/runs/{run_id}")
    def run(run_id: str) -> Any:
        return _json(found(records.run_detail, run_id))

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str) -> Any:
        return _json(found(open_run, run_id).metrics())

    @app.get("/api/runs/{run_id}/samples")
    def samples(run_id: str, step: int | None = None) -> Any:
        return _json(found(records.run_samples, run_id, step))

    @app.get("/api/runs/{run_id}/log", response_class=PlainTextResponse)
    def log(run_id: str, lines: int = Query(200, ge=1, le=5000)) -> PlainTextResponse:
        return PlainTextResponse(found(records.log_tail, run_id, lines), headers=NO_STORE)

    @app.get("/api/groups")
    def group_list() -> Any:
        return _json(groups.list_groups(where()))

    @app.get("/api/groups/{group_id}")
    def group(group_id: str) -> Any:
        return _json(found(groups.group_detail, group_id))

    @app.get("/api/compare")
    def compare(runs: str = "", run: Annotated[list[str] | None, Query()] = None) -> Any:
        """``?runs=a,b,c`` or ``?run=a&run=b``: each run's label, state and metrics."""
        run_ids = [r.strip() for r in [*runs.split(","), *(run or [])] if r.strip()]
        return _json(found(compare_runs, run_ids))

    @app.get("/api/evals")
    def evals() -> Any:
        return _json(list_evals(where()))

    @app.get("/api/evals/{eval_id}")
    def eval_result(eval_id: str) -> Any:
        return _json(found(read_eval, eval_id))

    @app.get("/api/endpoints")
    def endpoints() -> Any:
        return _json(list_endpoints(where()))

    return app


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no such numbers, browsers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _json(value: Any) -> JSONResponse:
    return JSONResponse(_finite(value), headers=NO_STORE)


def serve(host: str = "127.0.0.1", port: int = 8765, home: Path | None = None) -> None:
    """Run the dashboard until interrupted."""
    import uvicorn

    uvicorn.run(create_app(home), host=host, port=port, log_level="warning")
