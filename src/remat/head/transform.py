"""What a Hugging Face LM's forward does to its logits between its output embedding and its loss,
read from the forward's source and run as the forward runs it.

The chunked head never makes the full logits: it computes them a chunk at a time and hands each
chunk through the model's logit transform before the cross-entropy. Naming the transforms by
config field (``final_logit_softcapping``, ``logits_scaling``) mis-modelled models whose field
means something else (MiniCPM3's ``logits_scaling`` divides the hidden states *before* its
``lm_head``), that add a step (MuseGlimmer multiplies by ``output_multiplier`` before its soft-cap),
or that read the field from another config. So the transform is read from the forward itself:
:func:`read_transform` finds the statement that assigns the output embedding's call to a name
(``logits = self.lm_head(hidden_states[:, slice_indices, :])``), takes what the statements after it,
up to the loss, do to that name (with the values they read: ``self``, the module's globals, and
names the forward assigned from those alone, such as PaLI-Gemma's
``final_logit_softcapping = getattr(self.config.get_text_config(), ...)``), and makes them one
function of the logits (:class:`Transform`: its source, compiled once per source, so that a treated
model still pickles). :func:`check_transform` runs it at ``remat.apply`` on one row of the
vocabulary's width, so a transform that cannot run without the step's values, or that changes the
vocabulary's width (a slice to an unpadded vocabulary), is refused before the model is touched.

:func:`uncalled_head` finds an output embedding that the forward never calls as a module (MobileBERT's
masked-LM head multiplies by its decoder's weight directly): the chunked head intercepts that call.

Limits: only statements at the forward's top level and under its ``if`` blocks are read; a transform
that depends on the step's values (a temperature passed in ``kwargs``) is not read
(:func:`read_transform` returns None and the caller falls back on the config's fields); the probe
the chunked head runs in the first step (:func:`remat.head.hf_model.model_loss`) still checks
whichever transform it uses against what the forward really does.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from remat import caches

_Z = "__remat_logits"


@dataclass(frozen=True)
class Transform:
    """A forward's logit transform: ``source`` defines ``transform(self, logits)`` (module docstring);
    ``text`` is the forward's own statements, for messages. Plain data: compiled where it runs."""

    source: str
    text: str
    module: str  # the forward's module, whose globals the statements read

    def __call__(self, lm: nn.Module, logits):
        return _compiled(self.source, self.module)(lm, logits)


_COMPILED: dict = caches.register({}, "head.transform._COMPILED")


def _compiled(source: str, module: str):
    key = (source, module)
    if key not in _COMPILED:
        import sys
        namespace = dict(vars(sys.modules[module]))
        exec(compile(source, f"<remat: logit transform of {module}>", "exec"), namespace)  # noqa: S102
        _COMPILED[key] = namespace["transform"]
    return _COMPILED[key]


_READ: dict = caches.register({}, "head.transform._READ")  # (LM class, attribute) -> read_transform's answer: a class's source does not change


def read_transform(lm: nn.Module, attribute: str) -> Optional[Transform]:
    """``lm``'s logit transform, or None where it cannot be read (the head is not called by a statement
    ``name = ...self.<attribute>(...)...`` at the forward's top level, or what follows reads the step's
    values); a Transform whose ``text`` is empty is the identity. Read once per class.

    Example: for Gemma-2's ``logits = self.lm_head(hidden_states[:, slice_indices, :])`` followed by its
    soft-cap, ``read_transform(model, "lm_head").text`` is ``"if self.config.final_logit_softcapping is not
    None: logits = logits / self.config.final_logit_softcapping ..."``."""
    key = (type(lm), attribute)
    if key not in _READ:
        _READ[key] = _read(type(lm), attribute)
    return _READ[key]


def _read(kind: type, attribute: str) -> Optional[Transform]:
    forward = inspect.unwrap(kind.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [s for s in tree.body[0].body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    at = next((i for i, s in enumerate(body) if _calls(s, attribute)), None)
    if at is None or not (isinstance(body[at], ast.Assign) and len(body[at].targets) == 1
                          and isinstance(body[at].targets[0], ast.Name)):
        return None
    name = body[at].targets[0].id
    head = _ReplaceCall(attribute).visit(ast.parse(ast.unparse(body[at].value), mode="eval").body)
    after = []
    for statement in body[at + 1:]:
        text = ast.unparse(statement)
        if isinstance(statement, ast.Return) or _reads(statement, {"labels", "loss"}):
            break
        after.append(statement)
    needed = _needed(after, {name})
    known = set(dir(builtins)) | set(vars(inspect.getmodule(forward)))
    setup = _setup(body[:at], _free(needed, {name, "self"} | known), known)
    if setup is None:
        return None
    if _free(needed, {"self", name} | known | {t for s in setup for t in _targets(s)}):
        return None
    statements = setup + [ast.Assign(targets=[ast.Name(name, ast.Store())], value=head, lineno=0)] + needed
    lines = "\n".join("    " + line for s in statements for line in ast.unparse(s).splitlines())
    source = f"def transform(self, {_Z}):\n{lines}\n    return {name}\n"
    text = "; ".join(" ".join(ast.unparse(s).split()) for s in needed)
    head_text = ast.unparse(head)
    if head_text != _Z:
        text = f"{name} = {head_text.replace(_Z, f'self.{attribute}(...)')}" + (f"; {text}" if text else "")
    return Transform(source=source, text=text, module=forward.__module__)


class _ReplaceCall(ast.NodeTransformer):
    """The call of ``self.<attribute>(...)`` in an expression, replaced by the logits' name."""

    def __init__(self, attribute):
        self.attribute = attribute

    def visit_Call(self, node):
        if _is_head_call(node, self.attribute):
            return ast.Name(_Z, ast.Load())
        return self.generic_visit(node)


def _is_head_call(node, attribute) -> bool:
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == attribute and isinstance(func.value, ast.Name)
            and func.value.id == "self")


def _calls(statement, attribute) -> bool:
    return any(isinstance(n, ast.Call) and _is_head_call(n, attribute) for n in ast.walk(statement))


def _reads(statement, names) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(statement))


def _targets(statement) -> set:
    """Names a statement (or the ``if`` blocks in it) assigns."""
    found = set()
    for node in ast.walk(statement):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return found


def _free(statements, defined) -> set:
    """Names the statements read before assigning them, that ``defined`` does not hold (into the bodies
    of ``if``, ``for``, ``while`` and ``with`` statements, in order)."""
    free = set()

    def loads(node) -> set:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    def visit(block, assigned) -> set:
        for statement in block:
            if isinstance(statement, (ast.If, ast.While)):
                free.update(loads(statement.test) - assigned)
                assigned = assigned | visit(statement.body, set(assigned)) | visit(statement.orelse, set(assigned))
            elif isinstance(statement, ast.For):
                free.update(loads(statement.iter) - assigned)
                inner = assigned | {n.id for n in ast.walk(statement.target) if isinstance(n, ast.Name)}
                assigned = assigned | visit(statement.body, inner) | visit(statement.orelse, set(assigned))
            elif isinstance(statement, ast.With):
                for item in statement.items:
                    free.update(loads(item.context_expr) - assigned)
                assigned = assigned | visit(statement.body, set(assigned))
            else:
                free.update(loads(statement) - assigned)
                assigned = assigned | _targets(statement)
        return assigned

    visit(statements, set(defined))
    return free


def _needed(statements, names) -> list:
    """The statements, in order, that the final value of ``names`` depends on (read backwards): those
    that assign a needed name, or change one in place (``logits[...] = ...``, ``logits.div_(...)``)."""
    needed, wanted = [], set(names)
    for statement in reversed(statements):
        if _targets(statement) & wanted or _changes(statement, wanted):
            needed.append(statement)
            wanted |= {n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return list(reversed(needed))


def _changes(statement, names) -> bool:
    for node in ast.walk(statement):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, (ast.Subscript, ast.Attribute)) and _root(t) in names for t in targets):
                return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Attribute) and _root(node.value.func) in names:
            return True
    return False


def _root(node) -> Optional[str]:
    while isinstance(node, (ast.Subscript, ast.Attribute, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _setup(before, names, known) -> Optional[list]:
    """The statements before the head's call that assign ``names`` from ``self`` and the module's
    globals alone (and from each other), in order; None if a name has no such assignment."""
    chosen, wanted = [], set(names)
    for statement in reversed(before):
        if not isinstance(statement, ast.Assign) or not (_targets(statement) & wanted):
            continue
        reads = {n.id for n in ast.walk(statement.value) if isinstance(n, ast.Name)}
        chosen.append(statement)
        wanted = (wanted - _targets(statement)) | (reads - known - {"self"})
    if wanted:
        return None
    return list(reversed(chosen))


def check_transform(lm: nn.Module, transform: Transform, row) -> Optional[str]:
    """Why ``transform`` cannot be the chunked head's, or None: run on ``row`` (one row of the
    vocabulary's width, as the ``lm_head`` would return it) it raises, or it changes the row's shape."""
    try:
        out = transform(lm, row)
    except Exception as error:  # noqa: BLE001 - the model's own statements: any error means "not reproducible"
        return f"its forward post-processes the logits with `{transform.text}`, which raised {type(error).__name__} " \
               f"on a row of logits ({error})"
    if getattr(out, "shape", None) != row.shape:
        return (f"its forward post-processes the logits with `{transform.text}`, which turns a row of "
                f"{tuple(row.shape)} logits into {tuple(getattr(out, 'shape', ()))}")
    return None


def uncalled_head(lm: nn.Module, head: nn.Module) -> Optional[str]:
    """Where ``lm``'s output embedding ``head`` is used but never called as a module, or None: a module
    on the way from ``lm`` down to it whose forward reads the next one's attributes (its weight) and
    never calls it (a forward that does not name it at all may call it elsewhere: not refused here)."""
    path = next((name for name, module in lm.named_modules() if module is head), None)
    if not path:
        return None
    parent = lm
    for child in path.split("."):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(parent).forward))))
        except (OSError, TypeError, SyntaxError):
            return None
        uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == child
                and isinstance(n.value, ast.Name) and n.value.id == "self"]
        called = any(isinstance(n, ast.Call) and (n.func in uses or (
            isinstance(n.func, ast.Attribute) and n.func.attr == "forward" and n.func.value in uses)) for n in ast.walk(tree))
        if uses and not called:
            return (f"{type(parent).__name__}.forward uses self.{child} ({type(getattr(parent, child)).__name__}) "
                    f"without calling it")
        parent = getattr(parent, child)
    return None
