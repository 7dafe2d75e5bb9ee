"""``GET /metrics``: the server's counters, gauges and histograms in Prometheus' text
format (version 0.0.4), under vLLM 0.32's names where vLLM has the metric, labelled
``model_name``, and ``numkern:`` names for what it lacks.

Everything is recorded on the server's event loop (``engine.serve.app``), one thread, so
nothing here locks; the gauges come from the engine thread's snapshot after each step
(``engine.serve.worker.Snapshot``), replaced whole.
"""

import math

# vLLM 0.32's buckets (vllm/v1/metrics/loggers.py), so that dashboards made for it read ours
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _escape(v):
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels):
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def _num(x):
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, x):
        i = next((j for j, b in enumerate(self.buckets) if x <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += x

    @property
    def count(self):
        return sum(self.counts)

    def lines(self, name, labels):
        out, acc = [], 0
        for b, c in zip((*self.buckets, math.inf), self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(b)})} {acc}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {acc}")
        return out


class Metrics:
    """The server's metrics of one model (``model_name``)."""

    def __init__(self, model_name):
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {}  # finish reason -> requests (vllm:request_success_total)
        self.rejected = 0  # requests refused for a full queue (429)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.snapshot = None  # engine.serve.worker.Snapshot, the engine thread's

    def render(self):
        """The text of ``GET /metrics``."""
        m = {"model_name": self.model_name}
        s = self.snapshot
        out = []

        def one(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(lab)} {_num(v)}" for lab, v in samples)

        one(
            "vllm:num_requests_running",
            "gauge",
            "Requests in the running batch.",
            [(m, s.running if s else 0)],
        )
        one(
            "vllm:num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            [(m, s.waiting if s else 0)],
        )
        one(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage, the fullest KV-cache group's (1 means 100 percent).",
            [(m, s.kv_usage if s else 0.0)],
        )
        one(
            "vllm:prompt_tokens_total",
            "counter",
            "Prefill tokens processed.",
            [(m, self.prompt_tokens)],
        )
        one(
            "vllm:generation_tokens_total",
            "counter",
            "Generation tokens processed.",
            [(m, self.generation_tokens)],
        )
        one(
            "vllm:request_success_total",
            "counter",
            "Finished requests by finish reason.",
            [({**m, "finished_reason": r}, n) for r, n in sorted(self.finished.items())],
        )
        one(
            "vllm:num_preemptions_total",
            "counter",
            "Preemptions of running requests.",
            [(m, s.preemptions if s else 0)],
        )
        for name, hist, help_ in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("vllm:inter_token_latency_seconds", self.itl, "Time between output tokens."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency, arrival to end."),
        ):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            out.extend(hist.lines(name, m))
        groups = s.groups if s else ()
        one(
            "numkern:kv_cache_blocks_used",
            "gauge",
            "KV blocks in use, per KV-cache group.",
            [({**m, "group": str(i)}, used) for i, (used, _) in enumerate(groups)],
        )
        one(
            "numkern:kv_cache_blocks_total",
            "gauge",
            "KV blocks of each KV-cache group.",
            [({**m, "group": str(i)}, total) for i, (_, total) in enumerate(groups)],
        )
        one(
            "numkern:state_slots_used",
            "gauge",
            "GDN state slots in use (0: none).",
            [(m, s.slots_used if s else 0)],
        )
        one(
            "numkern:requests_rejected_total",
            "counter",
            "Requests refused with 429 (the queue held --max-waiting).",
            [(m, self.rejected)],
        )
        one(
            "numkern:engine_steps_total", "counter", "Engine steps run.", [(m, s.steps if s else 0)]
        )
        return "\n".join(out) + "\n"
