"""Einsum (torch.einsum) written as the Transpose, ReduceSum, Reshape and MatMul it means, ops ORT differentiates
(ORT 1.19 has no gradient builder for Einsum; part of `decompositions.decompose_ops_without_gradient`).

One or two operands, each index at most once per operand (no diagonals such as "ii->i"), ellipses included:

- an index of one operand only that the output drops is summed out of that operand first (ReduceSum);
- one operand: a Transpose into the output's order;
- two: the indices both keep (batch), each one's own kept indices and the indices they contract are grouped,
  A as (batch..., kept_A, contracted) and B as (batch..., contracted, kept_B); one batched MatMul; then the
  kept indices are unflattened and transposed into the output's order. Where each group is one index (a batched
  matrix product, e.g. attention's "...qd,...kd->...qk"), the MatMul takes the transposed operands as they are.

The sizes come from the operands' shapes at run time (a batch the export left dynamic stays so). The sums are the
ones Einsum computes, in a MatMul's order (as ORT's own Einsum kernel computes them, and torch's bmm).
"""

from collections.abc import Callable

Emit = Callable[[str, list[str], dict], str]  # (op, inputs, attributes) -> output name
Ints = Callable[[list[int]], str]  # an int64 constant -> its name


def parse(equation: str, ranks: list[int | None]) -> tuple[list[str], str] | None:
    """The operands' and the output's index strings, ellipses written out as indices of their own ("0", "1", ...,
    right-aligned across operands as broadcasting aligns them); None where the equation is outside what
    `decompose` handles."""
    equation = equation.replace(" ", "")
    lhs, arrow, output = equation.partition("->")
    operands = lhs.split(",")
    if not 1 <= len(operands) <= 2 or len(operands) != len(ranks):
        return None
    widths = []
    for term, rank in zip(operands, ranks, strict=True):
        if "..." not in term:
            widths.append(0)
        elif rank is None:
            return None
        else:
            widths.append(rank - len(term.replace("...", "")))
    ellipsis = "".join(str(i) for i in range(max(widths, default=0)))
    written = [
        t.replace("...", ellipsis[len(ellipsis) - w :] if w else "") for t, w in zip(operands, widths, strict=True)
    ]
    if not arrow:  # implicit output: the ellipsis, then the indices used once, alphabetically
        joined = "".join(written)
        output = ellipsis + "".join(sorted(c for c in set(joined) if joined.count(c) == 1 and not c.isdigit()))
    else:
        output = output.replace("...", ellipsis)
    used = set("".join(written))
    if any(len(set(t)) != len(t) for t in written) or len(set(output)) != len(output) or not set(output) <= used:
        return None
    return written, output


def _shape_part(emit: Emit, ints: Ints, shape: str, start: int, stop: int) -> str:
    return emit("Slice", [shape, ints([start]), ints([stop])], {})


def _size(emit: Emit, ints: Ints, shape: str, start: int, stop: int) -> str:
    """The product of dims start..stop of `shape` (1 for none), as a 1-element tensor."""
    if start == stop:
        return ints([1])
    return emit("ReduceProd", [_shape_part(emit, ints, shape, start, stop)], {"keepdims": 1})


def _transpose(emit: Emit, x: str, have: str, want: str) -> str:
    if have == want:
        return x
    return emit("Transpose", [x], {"perm": [have.index(c) for c in want]})


def decompose(inputs: list[str], terms: list[str], output: str, emit: Emit, ints: Ints) -> str:
    """The Einsum of `inputs` (index strings `terms`, from `parse`) into `output`'s indices."""
    values = list(inputs)
    for i, term in enumerate(terms):  # indices of this operand only, dropped by the output: summed out first
        others = set(output).union(*(t for j, t in enumerate(terms) if j != i))
        summed = [k for k, c in enumerate(term) if c not in others]
        if summed:
            values[i] = emit("ReduceSum", [values[i], ints(summed)], {"keepdims": 0})
            terms[i] = "".join(c for c in term if c in others)
    if len(terms) == 1:
        result = _transpose(emit, values[0], terms[0], output)
        return result if result != values[0] else emit("Identity", [result], {})
    a, b = terms
    batch = "".join(c for c in output if c in a and c in b)
    contracted = "".join(c for c in a if c in b and c not in output)
    kept_a = "".join(c for c in output if c in a and c not in b)
    kept_b = "".join(c for c in output if c in b and c not in a)
    left = _transpose(emit, values[0], a, batch + kept_a + contracted)
    right = _transpose(emit, values[1], b, batch + contracted + kept_b)
    nb, na, nc, nk = len(batch), len(kept_a), len(contracted), len(kept_b)
    if na == nc == nk == 1:  # already (batch..., i, k) and (batch..., k, j): one MatMul, nothing to group
        return _transpose(emit, emit("MatMul", [left, right], {}), batch + kept_a + kept_b, output)
    left_shape, right_shape = emit("Shape", [left], {}), emit("Shape", [right], {})
    left_batch = _shape_part(emit, ints, left_shape, 0, nb)
    right_batch = _shape_part(emit, ints, right_shape, 0, nb)
    k = _size(emit, ints, left_shape, nb + na, nb + na + nc)
    left = emit(
        "Reshape",
        [left, emit("Concat", [left_batch, _size(emit, ints, left_shape, nb, nb + na), k], {"axis": 0})],
        {},
    )
    right = emit(
        "Reshape",
        [right, emit("Concat", [right_batch, k, _size(emit, ints, right_shape, nb + nc, nb + nc + nk)], {"axis": 0})],
        {},
    )
    product = emit("MatMul", [left, right], {})
    dims = emit(
        "Concat",
        [
            _shape_part(emit, ints, emit("Shape", [product], {}), 0, nb),  # the batch as MatMul broadcast it
            _shape_part(emit, ints, left_shape, nb, nb + na),
            _shape_part(emit, ints, right_shape, nb + nc, nb + nc + nk),
        ],
        {"axis": 0},
    )
    unflat = emit("Reshape", [product, dims], {})
    return _transpose(emit, unflat, batch + kept_a + kept_b, output)
