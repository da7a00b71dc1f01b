"""`specquant serve`: an OpenAI-compatible HTTP server over one SpecEngine (FastAPI + uvicorn, imported only by
this package), and `specquant latency`: the leaderboard's latency protocol against any OpenAI-compatible server.

config.py (ServeConfig, LatencyConfig), requests.py (validation into a Request), text.py (incremental detokenizing
and stop strings), worker.py (the engine thread), prefix.py (the opt-in prefix cache), metrics.py (Prometheus),
app.py (the endpoints), cli.py, loopback.py (an app served in this process), latency.py."""
