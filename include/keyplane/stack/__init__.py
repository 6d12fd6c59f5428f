"""Production on one machine: ``keyplane stack up|down|status``.

Apache Kafka, a Spark standalone master with its workers, PostgreSQL and
Airflow's four components, started as the deployment of
``docker-compose.yml`` runs them but as processes of this machine, under
``$KEYPLANE_HOME/stack``. One module per piece, each a
:class:`~keyplane.stack.piece.Piece`; :mod:`keyplane.stack.network` puts the
Spark workers on hosts of their own (network namespaces joined by shaped
links); :mod:`keyplane.stack.stack` starts them in order and stops them in
reverse.
"""
