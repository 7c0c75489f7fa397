"""Every process-wide change torchjax makes, recorded where it is made, undone together.

Note [Process-wide changes]
``import torchjax`` makes "tpu" a torch device; that needs a few changes outside
torchjax's own objects. Each is recorded here (``record`` / ``replace_attr``) with why it
exists, how it is undone and the release of the patched package it was written for; the
version is checked when the change is made (``UntestedVersionWarning`` on another
release). ``torchjax.uninstall()`` undoes them all, newest first; ``torchjax.patches()``
lists the ones in force.

Each entry: the recorded name, where it is made, the release it was written for; why;
how it is undone.

- ``torch.utils.dlpack.to_dlpack`` and ``torch.to_dlpack`` (interop/_dlpack.py through
  _compat/torch.py; torch 2.13). torch's C++ exporter would hand out a capsule over a tpu
  tensor's empty storage (a null pointer); the wrapper exports a tpu tensor's jax array
  and hands every other tensor to torch's function. Undo: the originals put back.
- ``torch.utils.swap_tensors`` (device/_registration.py through _compat/torch.py; torch
  2.13). ``Module._apply`` always swaps a traceable wrapper subclass in, and torch's swap
  refuses a parameter that an autograd graph, an RNN's flat weights or a weakref still
  holds; when a tpu tensor is on either side the TensorImpls are swapped anyway and the
  stale gradient accumulator is poisoned (Note [Moving modules with live references]).
  Undo: torch's function put back.
- ``torch.autograd.graph.saved_tensors_hooks.__enter__`` (tensor/_backward_errors.py,
  installed by device/_registration.py; torch 2.13). An unpack hook that raised while
  the autograd engine unpacked a tpu tensor aborted the process (non-reentrant
  checkpointing's ``CheckpointError`` among them); the hooks pushed are wrapped so that
  such an error raises when the pass ends (Note [Errors inside the autograd engine]).
  Tensors on other devices are packed and unpacked by the user's hooks alone; the
  ``pack_hook`` / ``unpack_hook`` attributes keep the user's functions. Undo: torch's
  method put back.
- ``torch.autograd.function.BackwardCFunction.apply`` (and ``apply_boxed``;
  tensor/_grad_devices.py through _compat/torch_engine.py, installed by
  device/_registration.py; torch 2.13). The engine's device check of a custom Function's
  gradients is skipped for tensor subclasses, so a CPU gradient for a tpu input (or a
  tpu one for a CPU input) was accepted; the gradients a custom Function's backward
  returns are checked as the engine checks other devices' (Note [Gradient devices of
  custom Functions]). Gradients on their inputs' devices pass unchanged. Undo: torch's
  methods put back.
- ``torch.autograd.graph._engine_run_backward`` and ``torch.autograd._engine_run_backward``
  (device/_engine_queues.py through _compat/torch_engine.py; torch 2.13). tpu nodes on
  torch's tpu engine thread failed two ways: a backward run before ``import torchjax``
  left the engine without a tpu queue (every later tpu backward stopped at torch's
  internal assert), and that thread, which runs Python, could abort the process at exit.
  Every backward now runs with autograd multithreading off, every node on the calling
  thread (Note [Autograd device queues]). Same signature. Undo: both names get torch's
  function back.
- ``torch.utils.checkpoint._CheckpointFrame.get_inputs`` and
  ``torch.utils.checkpoint.detach_variable`` (compile/_remat.py through
  _compat/torch_checkpoint.py; torch 2.13). In a compiled program XLA merged a
  checkpointed region's recomputation with its forward, so checkpointing saved no memory;
  the inputs the recomputation starts from pass through an optimization barrier when
  they are traced (Note [Checkpointed regions in compiled programs]). Eager and CPU
  inputs pass unchanged. Same signatures. Undo: torch's method and function put back.
- ``torch._C._autograd._saved_tensors_hooks_disable and _enable`` (compile/_func_transforms.py
  through _compat/torch_saved_hooks.py; torch 2.13). ``torch.func.grad``, ``vjp`` and
  ``jacrev`` switch saved-tensor hooks off and refuse to run while any is on the stack,
  and a compiled program's trace keeps its own there: every such transform failed inside
  ``torchjax.jit`` and ``torch.compile(backend="tpu")``. While a trace's hooks are
  innermost, switching off takes them off the stack and switching on puts them back
  (Note [torch.func transforms in compiled programs]); otherwise both call torch's
  functions only. Same signatures. Undo: torch's functions put back.
- ``torch.amp.GradScaler._maybe_opt_step`` (compile/_grad_scaler.py through
  _compat/torch_amp.py; torch 2.13). ``scaler.step(opt)`` read whether the gradients were
  finite into Python, so no train step with a GradScaler could be traced; where that
  value is traced, the optimizer steps and its parameters and state keep their old
  values on the device where it was not finite (Note [GradScaler steps in compiled
  programs]). Concrete values (eager, torch.compile's graph breaks) take torch's method.
  Same signature. Undo: torch's method put back.
- ``torch.nn.Module.__call__`` (compile/_captured.py through _compat/torch_modules.py,
  made the first time fused eager mode turns on in the process, not at import; torch
  2.13). In fused eager mode the outermost call of a tpu module that repeats a
  signature runs as one captured program instead of recording its ops one by one (Note
  [Captured module calls]); every other call, and every call while no thread is in
  fused mode, goes to torch's ``_wrapped_call_impl`` unchanged. Same signature. Undo:
  torch's function put back (not made again in the process).
- ``torch.optim global optimizer step hooks`` (compile/_captured_optim.py through
  _compat/torch_optim.py, registered while fused eager mode is on in some thread and
  removed when it turns off, not at import; torch 2.13). A pre-hook and a post-hook on
  every ``Optimizer.step``: in fused eager mode a step on tpu parameters that repeats its
  signature runs as one captured program (Note [Captured optimizer steps]); every other
  step, and every step while no thread is in fused mode, runs as torch runs it. Undo:
  both hooks removed.
- ``torch.nn.Module._apply`` and ``torch.__future__.get_swap_module_params_on_conversion``
  (device/_registration.py through _compat/torch.py; torch 2.13). Moving a module off
  tpu (``model.cpu()``) made a new Parameter per module, untying tied weights and
  leaving an optimizer on the old ones; a module whose own parameters are on tpu is now
  moved with torch's swap path, selected for that thread and module only (Note [Moving
  modules off tpu]). Same signatures; every other module takes torch's path unchanged.
  Undo: both originals put back.
- ``torch.load`` (device/_serialization.py through _compat/torch.py; torch 2.13). torch
  clears the thread-local ``map_location`` of a load only when the unpickling returns;
  after a load that raises, later ``pickle.loads`` of device tensors in the thread are
  rebuilt where that load pointed, or refused; a legacy (non-zipfile) load never sets
  it, so device tensors ignored ``map_location``. The wrapper sets it for the load and
  restores it after, and fills tpu tensors of a legacy file once its bytes are read
  (Note [Legacy checkpoints]); same signature, and for CPU tensors the same result.
  Undo: the original put back.
- ``torch.UntypedStorage.__new__`` (device/_serialization.py; torch 2.13).
  ``torch.UntypedStorage(n, device="tpu")`` (and TypedStorage, which builds one) would
  allocate through the backend's allocator, which a Python backend does not have: the
  process crashed. For a tpu device the storage is made on CPU and given host-backed
  tpu bytes, as ``storage.tpu()`` does; every other device goes to torch's constructor
  unchanged. Undo: the class has no ``__new__`` of its own again.
- ``torch._utils.set_tensor_metadata`` (device/_serialization.py through
  _compat/torch.py; torch 2.13). torch.load's tensor rebuild sets a saved conj / neg bit
  on the rebuilt tensor with it; a tpu tensor must then read its storage through the bit
  (Note [Saving tpu tensors]), or a loaded conjugate view would show the plain values
  under ``is_conj()``. Same signature; the wrapper calls torch's function first and
  changes nothing for other tensors. Undo: the original put back.
- ``torch.UntypedStorage.tpu`` and ``torch.TypedStorage.tpu`` (device/_serialization.py;
  torch 2.13). What ``generate_methods_for_privateuse1_backend(for_storage=True)`` would
  add, without its allocation (a Python backend has no allocator): a host-backed tpu
  copy of the storage. Undo: the methods are deleted.
- ``aten::_pin_memory CPU kernel`` (device/_pinned.py; torch 2.13). "tpu" is torch's
  accelerator, so ``pin_memory()`` and ``DataLoader(pin_memory=True)`` would ask the
  Python backend for a pinned allocator it cannot have. The kernel runs torch's own for
  any other target (pins for real, or torch's error); for tpu it warns and returns an
  unpinned copy (Note [Pinned memory with a tpu accelerator]). Undo: its library is
  destroyed, torch's kernel is back.
- ``NestedTensorPrivateUse1 fallback``, ``torch.nested.nested_tensor`` and
  ``torch.nested.as_nested_tensor`` (device/_layouts.py; torch 2.13). A nested tensor
  with a tpu buffer is refused where it is made, with torchjax's message, instead of
  failing at every later op (Note [Unsupported layouts]); the constructors keep their
  signatures and results for every other device. Undo: the fallback's library is
  destroyed, the originals put back.
- ``torch.accelerator memory functions and synchronize`` (device/_accelerator.py; torch
  2.13). ``torch.accelerator.empty_cache``, ``memory_allocated``, ``memory_stats``,
  ``get_memory_info`` and the rest stop at torch's allocator assert for a Python backend,
  and ``synchronize`` raises; accelerate 1.16 calls ``empty_cache`` on every weight move.
  Asked about tpu, each answers with ``torch.tpu``'s function of the same meaning (Note
  [torch.accelerator on tpu]); same signatures. Undo: the originals put back in
  ``torch.accelerator`` and ``torch.accelerator.memory``.
- ``torch foreach tensor types`` (device/_optim_foreach.py through
  _compat/torch_optim.py; torch 2.13). ``JaxTensor`` appended to
  ``torch.optim.optimizer._foreach_supported_types`` and
  ``torch.utils._foreach_utils._foreach_supported_types``, as torch's DTensor appends
  itself: optimizers built with ``foreach=None`` (the default) and ``clip_grad_norm_`` /
  ``clip_grad_value_`` take their foreach path for tpu tensors, as for CUDA's, instead of
  a loop of a dozen ops per parameter (Note [tpu parameters take torch.optim's foreach
  path]). ``fused=True`` stays opt-in; CPU tensors' types are unchanged, so their path
  is too. Undo: ``JaxTensor`` taken out of the lists it was added to.
- ``DataLoader worker start`` (device/_dataloader.py through _compat/torch.py; torch
  2.13). ``_MultiProcessingDataLoaderIter.__init__`` wrapped: JAX's "os.fork() was
  called" warning is ignored while it starts the workers, which run CPU code only (Note
  [DataLoader workers and JAX's fork warning]). Undo: the original ``__init__`` back.
- ``Dynamo skip rules for torchjax`` (compile/_dynamo.py, when torch.compile first looks
  up the "tpu" backend; torch 2.13). torchjax/ joins Dynamo's SKIP_DIRS and every
  torchjax function's code gets the SKIP strategy: dispatch, the device guard and the
  kernels called from C++ must run as plain Python. Undo: the directory leaves SKIP_DIRS,
  the codes get Dynamo's DEFAULT strategy.
- ``FakeTensorMode.may_turn_const`` (compile/_dynamo.py, at the same time; torch 2.13).
  A real tpu tensor computed from constants while Dynamo traces (``torch.tensor(4)
  .to("tpu")``) is not folded into a constant FakeTensor, which the fake mode cannot make
  of a wrapper subclass (Note [No tpu constants in fake tracing]); every other tensor
  gets torch's answer. Same signature. Undo: torch's method put back.
- ``Dynamo OptimizerVariable._set_capturable`` (compile/_dynamo.py, at the same time;
  torch 2.13). Before Dynamo's own method, an optimizer whose parameters are all on tpu
  is made capturable as CUDA's are, its state moved to the device (Note [Compiled
  optimizers are capturable on tpu]); any other optimizer gets torch's answer. Same
  signature. Undo: torch's method put back.
- ``torch._TorchCompileInductorWrapper.__call__`` (compile/_default_backend.py through
  _compat/torch_dynamo.py; torch 2.13). ``torch.compile(m)`` without ``backend=`` hands each
  graph to this wrapper; a graph on tpu tensors is compiled by the "tpu" backend instead
  of inductor's torch_tpu code generation (Note [The default torch.compile backend on
  tpu]); other graphs reach inductor unchanged. Undo: torch's method put back.
- ``optimizer capturable=True under jit`` (compile/_capturable.py, per optimizer a jitted
  function or a Dynamo-traced step reaches; the optimizer's ``_init_group`` wrapped on the
  instance through _compat/torch.py; torch 2.13). The step counter must be a traced
  input, not a constant; the state a non-capturable step made moves to the device. Its
  float32 step counters on tpu become float64, existing ones when the optimizer is met
  and fresh ones as the wrapped ``_init_group`` makes them, so Adam's bias corrections
  are CPU eager's (Note [Step counters of compiled optimizers are float64]). Undo: those
  param groups back to ``capturable=False``, their step counters and the state moved
  back on CPU, the wrappers removed, step counters in torch's dtype again.
- ``sys.meta_path import hook`` (integrations/transformers/_loading.py, recorded by
  _patch_records.py; no release). A finder at ``sys.meta_path[0]`` that applies the
  transformers patches right after ``transformers.modeling_utils`` executes, so
  ``import torchjax`` never imports transformers; it removes itself when it fires.
  Undo: the finder is removed.
- ``transformers loading functions`` (same modules; transformers 5.24, the ``PATCHED_FOR``
  of _loading.py). ``PreTrainedModel._load_pretrained_model``, ``from_pretrained`` and
  ``modeling_utils.safe_save_file`` (the ``save_file`` that ``save_pretrained`` writes
  each shard with, bound at import) wrapped, and huggingface_hub's
  ``serialization._torch.get_torch_storage_size`` and ``get_torch_storage_id`` (a tpu
  tensor answered from its own storage): Note [Patching transformers' loading and
  saving]. Undo: ``_loading.uninstall()`` puts the originals back.
- ``jax persistent compilation cache`` (_compilation_cache.py, at import unless
  ``TORCHJAX_COMPILATION_CACHE=0`` or the user set a JAX cache directory or turned the
  cache off; jax 0.10). ``jax_compilation_cache_dir`` set to the user's cache directory
  and ``jax_persistent_cache_min_compile_time_secs`` from JAX's default 1 s to 0, so a
  second process loads the eager-op programs instead of compiling them (Note
  [Persistent compilation cache]). Undo: both options back, JAX's cache object dropped
  (through _compat/jax.py), so later compiles neither read nor write the directory.
- ``sys.meta_path import hook for accelerate.state``, ``sys.meta_path import hook for
  accelerate.utils.other``, ``sys.meta_path import hook for accelerate.checkpointing``,
  ``sys.meta_path import hook for accelerate.accelerator``,
  ``sys.meta_path import hook for accelerate.utils.offload``, ``sys.meta_path import hook
  for transformers.integrations.accelerate``, ``sys.meta_path import hook for
  transformers.trainer``, ``sys.meta_path import hook for transformers.generation.utils``,
  ``sys.meta_path import hook for accelerate.utils.dataclasses``, ``sys.meta_path import
  hook for safetensors.torch``, ``sys.meta_path import hook for kernels``,
  ``sys.meta_path import hook for transformers.integrations.moe`` and
  ``sys.meta_path import hook for torch._dynamo``
  (integrations/_after_import.py; no release): finders like the one above, one per
  module the patches below are applied to, so ``import torchjax`` imports none of these
  libraries; each removes itself when it fires. Undo: the finder is removed.
- ``accelerate PartialState.default_device`` (integrations/accelerate/_device.py;
  accelerate 1.16). accelerate before 1.16 picks its device from a list of backends it
  knows and never asks ``torch.accelerator``, so ``Accelerator()`` and the Trainer's
  batches stayed on cpu while transformers put the model on tpu; 1.16 answers ``tpu``
  without an index. The property answers accelerate's answer except that its cpu
  fallback, and an unindexed tpu, are ``tpu:<current index>`` when torch's accelerator is
  tpu (Note [accelerate's device on tpu]). Undo: the original property put back.
- ``transformers accelerate_max_memory`` (integrations/accelerate/_device.py;
  transformers 5.24). accelerate's ``get_max_memory`` as transformers' ``device_map="auto"``
  calls it, wrapped: with no ``max_memory`` given it offers the tpu devices too, so
  "auto" places layers on tpu instead of cpu (same Note). Undo: the original put back.
- ``accelerate clean_state_dict_for_safetensors`` and
  ``accelerate.checkpointing.load_model`` (integrations/accelerate/_saving.py; accelerate
  1.16). ``Accelerator.save_state`` / ``load_state`` dedup tied tensors by host storage
  pointer, which a tpu tensor does not have; the wrappers work from CPU copies that keep
  the sharing (Note [accelerate's safetensors save of tpu tensors]); other models go to
  accelerate's / safetensors' functions. Undo: the originals put back.
- ``accelerate save/load_accelerator_state`` (integrations/accelerate/_saving.py;
  accelerate 1.16). The names ``Accelerator.save_state`` / ``load_state`` call in
  ``accelerate.accelerator``, wrapped: accelerate's own run first, then the tpu RNG states
  are added to / restored from its ``random_states_<process>.pkl`` (Note [accelerate
  checkpoints and the tpu RNG]). Undo: the originals put back.
- ``accelerate OffloadedWeightsLoader.__getitem__`` (integrations/accelerate/_offload.py;
  accelerate 1.16). A disk-offloaded weight for a tpu execution device is read on CPU
  and moved to tpu (safetensors' reader refuses device "tpu"; Note [Offloaded weights
  onto tpu]). Undo: the original method put back.
- ``accelerate DynamoBackend._missing_`` (integrations/accelerate/_dynamo.py; accelerate
  1.16). ``DynamoBackend("TPU")`` answers one extra member, so
  ``torch_compile_backend="tpu"`` and ``Accelerator(dynamo_backend="tpu")`` reach
  ``torch.compile(backend="tpu")`` instead of ``ValueError: 'TPU' is not a valid
  DynamoBackend`` (Note [accelerate's Dynamo backend names]); other values get
  accelerate's answer, the listed members are unchanged. Undo: the enum's own
  ``_missing_`` again.
- ``safetensors.torch.load_file`` (integrations/_safetensors.py; safetensors 0.8).
  ``device="tpu"`` (or ``"tpu:N"``, a tpu ``torch.device``) reads the file with
  ``torchjax.checkpoint.load_file`` instead of failing in safetensors' Rust reader (Note
  [safetensors' load_file onto tpu]); same signature, every other device unchanged.
  Undo: the original put back.
- ``safetensors.torch.save_file`` (integrations/_safetensors.py; safetensors 0.8). A dict
  holding tpu tensors is checked by safetensors' own ``_evaluate_tensors_for_save`` and
  written one tensor at a time by torchjax.checkpoint's writer, the same bytes (Note
  [safetensors' save_file of tpu tensors]); ``save_model`` reaches it through the module.
  Same signature; CPU tensors go to safetensors unchanged. Undo: the original put back.
- ``transformers Trainer RNG state`` (integrations/transformers/_trainer.py; transformers
  5.24). ``Trainer._save_rng_state`` / ``_load_rng_state`` wrapped: transformers' own run
  first, then the tpu RNG states are added to / restored from ``rng_state.pth`` (Note
  [Trainer checkpoints and the tpu RNG]); signatures unchanged. Undo: the originals put
  back.
- ``transformers GenerationMixin.generate`` (integrations/transformers/_auto_compile.py;
  transformers 5.24). A ``generate`` call on a tpu model that transformers would
  auto-compile (static cache, compilation not disabled, the "tpu" or default backend)
  applies ``compile_generate`` to the model first, so its decode runs as device programs
  rather than transformers' per-token eager bookkeeping around a compiled forward (Note
  [transformers' auto-compile on tpu]); every other call, and every model off tpu, runs
  the original; same signature. ``TORCHJAX_AUTO_COMPILE_GENERATE=0`` turns the rule off.
  ``GenerationMixin._prepare_static_cache`` is wrapped with it: within an eager generate
  given the automatic static cache, the cache is made a length the attention kernels
  take (Note [A static cache for eager generate on tpu]); every other call runs the
  original; same signature. Undo: the originals put back (models compiled by it keep
  their ``compile_generate``).
- ``torch._dynamo backend 'tpu'`` (integrations/_dynamo_backend.py, right after
  ``torch._dynamo`` is imported; torch 2.13). torchjax's Dynamo backend registered under
  "tpu" with ``torch._dynamo.register_backend``, so ``torch.compile(backend="tpu")`` works
  where torchjax is importable without its package's entry point (a checkout on
  ``PYTHONPATH``; Note [Finding the "tpu" Dynamo backend]). Not made when a "tpu" backend
  is registered already. Undo: the name taken off Dynamo's registry (through
  _compat/torch_dynamo.py); an installed entry point serves it again.
- ``torch.backends.tpu`` (integrations/kernels/_backend.py, right after ``kernels`` is
  imported, unless something already set it; kernels 0.17). ``kernels`` selects its TPU
  backend, and so a kernel repository's ``torch-tpu`` build variant, only when
  ``torch.backends.tpu`` exists; a module with ``is_available()``/``is_built()`` is set
  there and in ``sys.modules`` (Note [The Kernels Hub backend on tpu]). Undo: both
  removed, unless replaced since.
- ``torch._subclasses.fake_tensor logger filter`` (tensor/_fake_errors.py through
  _compat/torch_dynamo.py, when torch.compile first traces an op on tpu tensors; torch 2.13).
  FakeTensorMode logs a failing meta kernel's exception with its traceback at error
  level; for an op on fake tpu tensors that eager refuses, eager's error is raised
  instead (Note [Errors of ops traced with fake tensors]), so the filter holds that
  thread's records while such an op runs and lets them through unless eager's error
  replaced the meta kernel's. Every other record passes. Undo: the filter removed.
- ``transformers ExpertsInterface entry`` (integrations/transformers/_moe.py, right after
  ``transformers.integrations.moe`` runs, or when the user calls ``register_experts()``;
  transformers 5.24). "torchjax_ragged_dot" in transformers' global experts registry, so
  ``set_experts_implementation("torchjax_ragged_dot")`` and
  ``from_pretrained(..., experts_implementation="torchjax_ragged_dot")`` find it; a name
  added, no existing entry changed, so CPU code that does not name it runs as before.
  Undo: the entry is deleted.

Not undone (torch has no way back): the PrivateUse1 backend renamed to "tpu" with its
device module ``torch.tpu`` and device guard, and kernels registered for the PrivateUse1,
AutogradPrivateUse1 and AutocastPrivateUse1 keys (factories, copies, SDPA, autocast);
the ``os.register_at_fork`` child hook that makes tpu tensors refuse work in a child
forked after JAX started (device/_fork.py, Note [tpu tensors after fork]; it acts in the
child only); and the tpu loader in ``torch.serialization``'s package registry
(device/_serialization.py, Note [Loading checkpoints onto tpu]), kept because without
it ``torch.load`` onto "tpu" reaches torch's PrivateUse1 path, which crashes the process
on a backend with no allocator; it answers tpu locations only.
Not a patch, but felt outside torchjax: when torchjax's executable cache budget turns
over (as many evictions as it holds entries), jax's Python-side staging caches are
cleared (_budget.py through _compat/jax.py; jax 0.10), since one of them has no bound
(Note [Executable cache budget]); the user's jitted functions keep their executables.
``TORCHJAX_CLEAR_JAX_CACHES=0`` or ``set_cache_budget(clear_jax_caches=False)`` turns it
off.
They change nothing for tensors on other devices; tpu tensors keep working after
``uninstall()``, with torch's own behaviour for the entries above (e.g. ``to_dlpack`` of a
tpu tensor is torch's, invalid, capsule again).

This module imports nothing from torchjax, so every layer can record into it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import threading
import warnings
from collections.abc import Callable


class UntestedVersionWarning(UserWarning):
    """A process-wide patch was applied to a release it was not written for."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One process-wide change in force (see Note [Process-wide changes])."""

    name: str
    why: str
    package: str | None
    written_for: str | None
    undo: Callable[[], None] = dataclasses.field(repr=False, compare=False)


_LOCK = threading.Lock()
_INSTALLED: dict[str, Patch] = {}
_WARNED: set[tuple[str, str]] = set()
_MISSING = object()


@functools.lru_cache(maxsize=None)
def _version(package: str) -> str | None:
    """The installed release of distribution ``package`` (None when not installed).
    Cached: reading package metadata takes milliseconds, and the patch of
    ``nn.Module.__call__`` is recorded each time fused eager mode turns on."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _same_release(version: str, written_for: str) -> bool:
    """True when ``version`` (e.g. "2.13.0+cpu") is in release ``written_for`` ("2.13")."""
    want = written_for.split(".")
    return version.split("+")[0].split(".")[: len(want)] == want


def check_version(name: str, package: str, written_for: str) -> None:
    """Warn (once per package release) when ``package`` is not ``written_for``."""
    version = _version(package)
    if version is None or _same_release(version, written_for):
        return
    with _LOCK:
        if (package, version) in _WARNED:
            return
        _WARNED.add((package, version))
    warnings.warn(
        f"torchjax: the process-wide patch {name!r} was written for {package} {written_for}, "
        f"but {package} {version} is installed; it may not fit this release. Install "
        f"{package}=={written_for}.* or report what fails (torchjax.patches() lists every "
        "patch; torchjax.uninstall() undoes them).",
        UntestedVersionWarning,
        stacklevel=3,
    )


def record(name: str, *, why: str, package: str | None, written_for: str | None, undo) -> None:
    """Record a change just made (idempotent by name: the first record's undo is kept).
    ``package=None``: a change to the interpreter (``sys.meta_path``), no release to check."""
    if package is not None:
        check_version(name, package, written_for)
    with _LOCK:
        _INSTALLED.setdefault(name, Patch(name, why, package, written_for, undo))


def is_recorded(name: str) -> bool:
    return name in _INSTALLED


def replace_attr(owner, attr: str, new, *, name: str, why: str, package: str, written_for: str):
    """``setattr(owner, attr, new)``, recorded; undo restores the original object (the
    raw class-``__dict__`` entry for a class, so a staticmethod stays one)."""
    return replace_attrs(
        owner, {attr: new}, name=name, why=why, package=package, written_for=written_for
    )[attr]


def replace_attrs(owner, new: dict, *, name: str, why: str, package: str, written_for: str):
    """``replace_attr`` of several attributes of ``owner`` as one recorded change (a save
    and load pair); returns the originals by attribute."""
    if isinstance(owner, type):
        originals = {attr: owner.__dict__.get(attr, _MISSING) for attr in new}
    else:
        originals = {attr: getattr(owner, attr, _MISSING) for attr in new}

    def undo():
        for attr, original in originals.items():
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    for attr, value in new.items():
        setattr(owner, attr, value)
    record(name, why=why, package=package, written_for=written_for, undo=undo)
    return originals


def undo(name: str) -> None:
    """Undo the recorded change ``name`` now (nothing if it is not in force)."""
    with _LOCK:
        patch = _INSTALLED.pop(name, None)
    if patch is not None:
        patch.undo()


def installed() -> list[Patch]:
    """The changes in force, oldest first."""
    with _LOCK:
        return list(_INSTALLED.values())


_UNINSTALLED = [False]


def uninstalled() -> bool:
    """Whether ``uninstall()`` ran: changes made on demand (``nn.Module.__call__`` in fused
    eager mode) are not made again."""
    return _UNINSTALLED[0]


def uninstall() -> None:
    """Undo every recorded change, newest first. Every undo runs; the first error is
    raised after the others ran."""
    _UNINSTALLED[0] = True
    with _LOCK:
        patches = list(_INSTALLED.values())[::-1]
        _INSTALLED.clear()
    first = None
    for p in patches:
        try:
            p.undo()
        except (AttributeError, KeyError, RuntimeError, ValueError) as e:  # keep undoing
            first = first or RuntimeError(f"torchjax.uninstall(): undoing {p.name!r} failed: {e}")
    if first is not None:
        raise first
