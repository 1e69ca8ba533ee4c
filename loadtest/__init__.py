"""Load-test driver: replay real traces against a router and report latency metrics.

Modules, in pipeline order:

* :mod:`traces` - parsers of the Azure 2023 and Mooncake FAST'25 traces;
* :mod:`workload` - a bounded plan of requests (arrival times, clipped lengths);
* :mod:`prompts` - exact-length token-id prompts cut from real text;
* :mod:`runner` - open/closed-loop sending and per-token timestamps;
* :mod:`records`, :mod:`metrics` - per-request records, TTFT/TPOT/ITL/E2E, SLOs, goodput;
* :mod:`report`, :mod:`plots`, :mod:`live` - JSON/markdown/table output, PNGs, progress bar;
* :mod:`driver` - :func:`driver.run_loadtest`, everything end to end;
* :mod:`cli` - the ``pdcluster loadtest`` subcommand.
"""
