"""What a worker tells its operators: the counters the backend thread bumps (``metrics``), the
Prometheus endpoint that serves their copies (``exporter``, its own HTTP thread), and log lines for
people or collectors (``logs``, configured by the main thread). Imports nothing on import.
"""
