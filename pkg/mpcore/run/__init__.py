"""`mpcore run`: the hooks that serve every process of a program (_boot),
running a program as python would (_program), torchrun's command line
(_torchrun) and its rendezvous (_rdzv), and the command itself
(_launcher).  The top of the package, over its faces; NOTE [ Layers of the
package ] in mpcore/__init__.py."""
