import itertools

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune, set_bench_func

_names = itertools.count()


_last_launch = []  # (toy, run_config, x) of the latest toy launch


class FakeBench:
    """Per-toy record of what was timed; a candidate "takes" ``ms(config)`` (default 1.0 ms)."""

    def __init__(self):
        self.ms = lambda cfg: 1.0 if cfg is None else float(cfg["ms"])
        self.ms_at = None  # optional (cfg, rows of x) -> ms, for searches over several inputs
        self.timed = []
        self.inputs = []


def fake_bench(run):
    """The timer every toy installs: runs the candidate once, charges it to the toy that launched."""
    run()
    toy, cfg, x = _last_launch[-1]
    toy.bench.timed.append(cfg)
    toy.bench.inputs.append(x)
    return toy.bench.ms(cfg) if toy.bench.ms_at is None else toy.bench.ms_at(cfg, x.shape[0])


class Toy:
    """A launcher ``scale(x, out, alpha=2.0, run_config=None)`` writing ``out = alpha * x`` (+ config bias)."""

    def __init__(self, kernel_type=AutotuneKernelType.GENERAL, configs=None, **autotune_kwargs):
        self.name = f"toy_{next(_names)}"
        self.log = []  # (run_config, x) of every launch
        self.configs = configs if configs is not None else [{"ms": 0.5}, {"ms": 0.2}, {"ms": 0.9}]
        self.bias = {}  # config ms -> value added to out, to make a config wrong
        self.fail = set()  # config ms values that raise
        kwargs = dict(
            kernel_name=self.name,
            configs_gen_func=lambda: self.configs,
            static_key_func=lambda x, alpha: {"dtype": x.dtype, "alpha": alpha},
            run_key_func=lambda x: x.shape[0],
            kernel_type=kernel_type,
            output_args=("out",),
        )
        kwargs.update(autotune_kwargs)

        @autotune(**kwargs)
        def scale(x, out, alpha=2.0, run_config=None):
            self.log.append((run_config, x))
            _last_launch[:] = [(self, run_config, x)]
            ms = None if run_config is None else run_config["ms"]
            if ms in self.fail:
                raise RuntimeError("out of resources")
            torch.mul(x, alpha, out=out)
            out.add_(self.bias.get(ms, 0.0))
            return out

        self.kernel = scale
        self.bench = FakeBench()
        set_bench_func(fake_bench)

    def __call__(self, n=4, **kwargs):
        x = torch.randn(n, 3)
        out = torch.full_like(x, float("nan"))
        result = self.kernel(x, out, **kwargs)
        torch.testing.assert_close(out, x * kwargs.get("alpha", 2.0), rtol=0, atol=0)
        return result

    def configs_used(self):
        return [cfg for cfg, _ in self.log]

    def reset_log(self):
        self.log.clear()
        self.bench.timed.clear()


@pytest.fixture
def toy():
    return Toy
