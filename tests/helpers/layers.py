"""What the layer tests of the C core (csrc/test_csrc_layers.py,
csrc/test_csrc_lint.py) and of the Python package (package/test_py_layers.py)
share: the search for a cycle among files or modules, and the length past
which a file says why it stays whole."""

# "About 800 lines": a source longer than this is split along its seams, or
# its header comment says why it stays whole.
LONG = 820


def find_cycle(edges):
    """A list of nodes (files, modules) forming a cycle (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {n: WHITE for n in edges}
    stack = []

    def visit(n):
        colour[n] = GREY
        stack.append(n)
        for m in sorted(edges[n]):
            if colour[m] == GREY:
                return stack[stack.index(m):] + [m]
            if colour[m] == WHITE:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        colour[n] = BLACK
        return None

    for n in sorted(edges):
        if colour[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None
