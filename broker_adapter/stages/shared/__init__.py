"""What several stages are built from, and no stage owns: the stage loop and the idle
policy (``loop``), the one reply-publishing path (``publish``), trace context
(``tracing``), the handler runtime (``handlers``, ``calls``) and the hand-off of new tasks
to idle workers (``handoff``).

A module here never imports a stage."""
