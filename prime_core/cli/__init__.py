"""The ``prime`` command line. ``build_app(manager)`` builds it; ``main()`` runs it."""
