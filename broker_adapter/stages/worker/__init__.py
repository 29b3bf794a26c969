"""The worker stage: claims tasks (or takes those handed to it), calls their handlers under
a lease, and commits each terminal state with its reply (``worker``); its settings
(``config``), leases (``lease``), routing of named tasks (``routing``), the gate of declared
side effects (``effect_gate``), the counting of outcomes (``outcomes``) and the publication
of its own replies right after its commit (``replies``)."""
