"""``python -m keyplane.spark.jvm [--out PATH]``: build the JVM stages' jar."""

from keyplane.spark.jvm import main

main()
