"""The direct launch path (kernels/direct_launch.py): which argument changes force ``kernel[grid]``, that a direct
launch runs the compiled kernel Triton's own specialization picks, and that the interpreter always takes
``kernel[grid]``. On the CPU a stand-in kernel records launches; Triton's own ``native_specialize_impl`` keys it."""

import itertools

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from lightllm.kernels import direct_launch
from lightllm.kernels.direct_launch import DirectLaunch, int_class, tensor_class

_INTS = [0, 1, 2, 3, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
         2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, -(2**63)]  # fmt: skip


def _triton_spec(value):
    return native_specialize_impl(BaseBackend, value, False, True, True)


def test_int_class_is_exactly_tritons_specialization():
    for a, b in itertools.combinations(_INTS, 2):
        assert (int_class(a) == int_class(b)) == (_triton_spec(a) == _triton_spec(b)), (a, b)


def test_tensor_class_is_exactly_tritons_specialization():
    base = {dtype: torch.zeros(64, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    views = [t[offset:] for t in base.values() for offset in range(9)]
    for x, y in itertools.combinations(views, 2):
        assert (tensor_class(x) == tensor_class(y)) == (_triton_spec(x) == _triton_spec(y)), (x.dtype, y.dtype)


def _kernel(X, Y, n, stride, eps, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, TAIL: tl.constexpr = 7):
    pass


class _Compiled:
    """What kernel[grid] returns: its launcher records the direct launches."""

    def __init__(self, key):
        self.key, self.function, self.packed_metadata, self.direct_calls = key, object(), object(), []

    @property
    def run(self):
        return lambda *a: self.direct_calls.append(a)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


def _pdl_kernel(X, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pass


class _StandInKernel:
    """A JITFunction's parameters with ``kernel[grid]`` replaced: it 'compiles' one kernel per Triton specialization
    (its own binder's key: ``native_specialize_impl`` per argument, constexpr values, options) and records the call."""

    def __init__(self, fn=_kernel):
        self.jit = JITFunction(fn)
        self.params, self.arg_names, self.pre_run_hooks = self.jit.params, self.jit.arg_names, []
        self.compiled, self.slow_calls = {}, []

    def key(self, args, kwargs):
        options = {k: v for k, v in kwargs.items() if k not in self.jit.signature.parameters}
        bound = self.jit.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
        bound.apply_defaults()
        spec = tuple(("constexpr", v) if p.is_constexpr else _triton_spec(v)
                     for p, v in zip(self.params, bound.arguments.values()))  # fmt: skip
        return spec, tuple(sorted(options.items())), tuple(bound.arguments.values())

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            spec, options, _ = self.key(args, kwargs)
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled.setdefault((spec, options), _Compiled((spec, options)))

        return run


class _StubDriver:
    """Triton's driver for a GPU that is not there: what kernel[grid] and the direct path ask it."""

    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(driver, "_active", _StubDriver())
    kernel = _StandInKernel()
    return kernel, DirectLaunch(kernel, direct=True)


def _launch(kernel, launcher, grid, args, kwargs):
    """Launch; True when it went direct. A direct launch must run the kernel Triton's key picks, with every
    argument (keywords and defaults in signature order) and the grid padded to three dims."""
    slow, spec = len(kernel.slow_calls), kernel.key(args, kwargs)
    launcher.launch(grid, *args, **kwargs)
    if len(kernel.slow_calls) > slow:
        return False
    compiled = kernel.compiled[spec[:2]]
    call = compiled.direct_calls[-1]
    g = tuple(grid) + (1,) * (3 - len(grid))
    assert call[:3] == g and call[3] == 1234 and call[4] is compiled.function and call[5] is compiled.packed_metadata
    assert call[9:] == spec[2]
    return True


def test_which_argument_changes_force_the_fallback(stand_in):
    kernel, launcher = stand_in
    x, y = torch.zeros(64), torch.zeros(64)
    args, kw = (x, y, 32, 64, 1e-6, 128, True), {"num_warps": 4}

    def direct(*changed, **kw_changed):
        new = list(args)
        for i, v in changed:
            new[i] = v
        return _launch(kernel, launcher, (3,), tuple(new), {**kw, **kw_changed})

    assert not direct()  # the first launch binds
    assert direct()
    assert direct((0, torch.zeros(64)), (2, 48), (3, 4096), (4, 0.5))  # same classes: pointers, ints, a float
    assert not direct((0, x[1:]))  # a pointer no longer 16-byte aligned
    assert direct((0, x[1:]))  # ... bound as well now
    assert direct()  # the first binding is kept beside it
    assert not direct((0, torch.zeros(64, dtype=torch.float16)))  # another dtype
    assert not direct((2, 33))  # an int no longer divisible by 16
    assert not direct((2, 1))  # an int equal to 1 (a constexpr to Triton)
    assert not direct((3, 2**31))  # an int past int32
    assert not direct((4, 1))  # an int where a float was
    assert not direct((5, 256))  # a positional constexpr
    assert not direct((6, 1))  # a constexpr of another type with an equal value (1 == True)
    assert not direct(num_warps=8)  # an option
    assert not direct(TAIL=9)  # a keyword constexpr (a default before)
    assert direct(TAIL=9)


def test_launches_on_another_device_fall_back(stand_in, monkeypatch):
    kernel, launcher = stand_in
    args = (torch.zeros(8), torch.zeros(8), 16, 16, 0.1, 4, False)
    assert not _launch(kernel, launcher, (1, 2), args, {})
    monkeypatch.setattr(driver.active, "device", 1)
    assert not _launch(kernel, launcher, (1, 2), args, {})
    assert _launch(kernel, launcher, (1, 2), args, {})


def test_disabled_kernels_with_pre_run_hooks_and_arguments_it_cannot_classify_take_kernel_grid(stand_in):
    kernel, launcher = stand_in
    args = (torch.zeros(8), torch.zeros(8), 16, 16, 0.1, 4, False)
    assert not _launch(kernel, launcher, (1,), args, {})
    previous = direct_launch.set_enabled(False)
    try:
        assert not _launch(kernel, launcher, (1,), args, {})
    finally:
        direct_launch.set_enabled(previous)
    assert _launch(kernel, launcher, (1,), args, {})
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    assert not _launch(kernel, launcher, (1,), args, {})
    kernel.pre_run_hooks.clear()
    odd = (torch.zeros(8), torch.zeros(8), 16, 16, (1, 2), 4, False)  # a tuple argument: never bound
    assert not _launch(kernel, launcher, (1,), odd, {})
    assert not _launch(kernel, launcher, (1,), odd, {})


def test_launch_hooks_get_the_metadata_kernel_grid_gives_them(stand_in, monkeypatch):
    from triton import knobs

    kernel, launcher = stand_in
    args = (torch.zeros(8), torch.zeros(8), 16, 16, 0.1, 4, False)
    launcher.launch((2,), *args)
    enter, leave = (lambda *a: None), (lambda *a: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", leave)
    launcher.launch((2,), *args)
    call = next(iter(kernel.compiled.values())).direct_calls[-1]
    assert call[6] == ("metadata", (2,)) and call[7] is enter and call[8] is leave


def test_the_interpreter_always_takes_kernel_grid_with_identical_results():
    from lightllm.kernels.norm.add_rmsnorm import _ADD_RMSNORM, _add_rmsnorm_kernel

    assert not isinstance(_add_rmsnorm_kernel, JITFunction) and not _ADD_RMSNORM.direct
    torch.manual_seed(0)
    r, x, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    outs, before = [], _ADD_RMSNORM.slow_launches
    for launch in (_ADD_RMSNORM.launch, lambda grid, *a, **k: _add_rmsnorm_kernel[grid](*a, **k)):
        residual, out = r.clone(), torch.full((3, 40), float("nan"))
        launch((3,), residual, x, w, out, 40, 40, 40, 40, 1e-6, 64, True, num_warps=1)
        outs.append((residual, out))
    assert _ADD_RMSNORM.slow_launches == before + 1
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.isnan(outs[0][1]).any()


def test_the_guard_is_true_exactly_when_every_class_matches():
    """The generated guard against the classes themselves, argument by argument and several at once: pointers of
    three alignments and two dtypes, ints across every class boundary, a float, positional constexprs."""
    kernel = _StandInKernel()
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], torch.zeros(64, dtype=torch.float16)]
    ints = [0, 1, 2, 16, 17, -16, -17, 2**31 - 16, 2**31, 2**31 + 1, 2**63, -(2**31) - 16]
    scalars = [0.5, 2.0, 3]  # the eps slot: two floats, an int

    def classes(args):
        x, y, n, stride, eps, block, one_pass = args
        return (tensor_class(x), tensor_class(y), int_class(n), int_class(stride), type(eps), (type(block), block),
                (type(one_pass), one_pass))  # fmt: skip

    rng = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    for _ in range(60):
        bound = (pick(tensors), pick(tensors), pick(ints), pick(ints), pick(scalars), pick([64, 128]), pick([True, 1]))
        b = direct_launch.bind(kernel, _Compiled(None), 0, bound, {})
        for _ in range(25):
            other = list(bound)
            for i in torch.randperm(7, generator=rng)[: int(torch.randint(1, 4, (1,), generator=rng))].tolist():
                other[i] = pick({0: tensors, 1: tensors, 2: ints, 3: ints, 4: scalars, 5: [64, 128],
                                 6: [True, 1, False]}[i])  # fmt: skip
            assert b.matches(tuple(other)) == (classes(other) == classes(bound)), (bound, other)


def test_pdl_gives_its_constexpr_and_launch_option_only_to_kernels_that_declare_it(monkeypatch):
    monkeypatch.setattr(driver, "_active", _StubDriver())
    plain, pdl = _StandInKernel(), _StandInKernel(_pdl_kernel)
    plain_launcher, pdl_launcher = DirectLaunch(plain, direct=True), DirectLaunch(pdl, direct=True)
    assert pdl_launcher.pdl_ready and not plain_launcher.pdl_ready
    plain_args, pdl_args = (torch.zeros(8), torch.zeros(8), 16, 16, 0.1, 4, False), (torch.zeros(8), 16, 32)
    monkeypatch.setattr(direct_launch, "_pdl", True)
    assert not _launch(plain, plain_launcher, (1,), plain_args, {"num_warps": 4})
    assert plain.slow_calls[-1][2] == {"num_warps": 4}  # nothing added to a kernel without USE_PDL
    pdl_launcher.launch((2,), *pdl_args, num_warps=4)
    assert pdl.slow_calls[-1][2] == {"num_warps": 4, "USE_PDL": True, "launch_pdl": True}
    assert _launch(pdl, pdl_launcher, (2,), pdl_args, {"num_warps": 4, "USE_PDL": True, "launch_pdl": True})
    monkeypatch.setattr(direct_launch, "_pdl", False)  # off again: its own binding, compiled without either
    assert not _launch(pdl, pdl_launcher, (2,), pdl_args, {"num_warps": 4})
    assert pdl.slow_calls[-1][2] == {"num_warps": 4} and len(pdl.compiled) == 2


def test_pdl_is_refused_without_a_gpu_that_has_it():
    from triton import knobs

    assert not direct_launch._pdl
    if knobs.runtime.interpret or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        with pytest.raises(ValueError, match=r"set_pdl\(True\): programmatic dependent launch expected (a CUDA GPU|"
                                             r"compute capability 9.0)"):  # fmt: skip
            direct_launch.set_pdl(True)
        assert direct_launch.set_pdl(False) is False  # nothing was changed
    else:
        assert direct_launch.set_pdl(True) is False
        assert direct_launch.set_pdl(False) is True


def test_the_kernels_of_a_decode_layer_declare_pdl():
    from lightllm.kernels import activation
    from lightllm.kernels.attention.decode import flash_decode
    from lightllm.kernels.linear import small_m_kernel
    from lightllm.kernels.norm import add_rmsnorm, qk_norm_rope, rmsnorm

    launchers = [small_m_kernel._LINEAR, small_m_kernel._SUM_SPLITS, add_rmsnorm._ADD_RMSNORM, rmsnorm._RMSNORM]
    launchers += [qk_norm_rope._QK_NORM_ROPE, activation._SILU_MUL, flash_decode._STAGE1, flash_decode._STAGE2]
    assert all(launcher.pdl_ready for launcher in launchers)
