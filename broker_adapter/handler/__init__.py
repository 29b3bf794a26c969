"""What a handler is written with: the ``Task`` it receives (``task``), the ``Router`` of
named tasks (``router``) and the declaration of its side effects (``effects``).

It sits below the stages and the client: both read these definitions, neither is imported
here."""
