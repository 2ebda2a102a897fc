"""The controller's status surface: what the port answers to readers who hold no credential, and the
operator's `POST /start`.

- `http.py`: the aiohttp app (state.json, `/metrics`, `POST /start`, the page's routes); `httpconn.py`: one
  HTTP connection after the mux routed it (its lifetime, the port's write budget); `fastget.py`: a plain
  `GET /state.json` answered from cached bytes without aiohttp.
- `snapshot.py`: `StateCache` (one build per change and interval, encoded once for every reader),
  `RenderBudget` (the loop time unauthenticated readers may spend), `StormLog`.
- `summary.py`: the one pure summariser of state.json: the wording of its headline (phase, start
  switch, ranks, clocks, attempts, service) and of its finished runs, which the page, the page's script
  (through state.json's `summary`) and `fdl status` all show.
- `page.py` (the page as a pure function of state.json), `wording.py` (its row wordings),
  `page_routes.py` (serving it), `static/` (its script and style, package data); `metrics.py`
  (Prometheus text); `source.py` (what the app asks of a run or service: `StatusSource`).
"""
