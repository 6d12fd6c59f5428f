package keyplane.spark.jvm;

import java.net.InetAddress;
import java.net.UnknownHostException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.sql.Timestamp;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import org.apache.spark.TaskContext;
import org.apache.spark.api.java.function.MapFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.streaming.OutputMode;
import org.apache.spark.sql.streaming.StatefulProcessor;
import org.apache.spark.sql.streaming.TTLConfig;
import org.apache.spark.sql.streaming.TimeMode;
import org.apache.spark.sql.streaming.TimerValues;
import org.apache.spark.sql.streaming.ValueState;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;
import scala.Tuple3;
import scala.jdk.javaapi.CollectionConverters;

/**
 * The routed job's two stages for the reference application's running count, in the JVM.
 *
 * <p>The same protocol as the Python stages of {@code keyplane.spark.routed_counts} (see its
 * module docstring): each group handles its rows in the order of paper 000 §3.4 (install moved
 * states once per marker and source, add the batch's events, evict), stage A reports its partials
 * through stage B's control groups, and stage B writes {@code count}, {@code moved}, {@code hop}
 * and {@code pair} rows of {@code ROUTED_OUTPUT_SCHEMA}. A group's state lives in Spark's own
 * keyed state store as (encoded state, count, marker), as the Python stages keep it.
 *
 * <p>Why a second implementation: PySpark serves each state call of a Python {@code
 * transformWithState} with a socket round trip to the executor's JVM, about 0.46 ms per group on
 * the reference machine, five times what a key of Spark's own count costs (docs/benchmarks.md,
 * "The floor under a Python stateful stage"). In the JVM a state call is a method call. Users'
 * own aggregates keep running in Python; the running count, whose state is a number, runs here.
 */
public final class RoutedStages {
  private RoutedStages() {}

  static final String CONTROL_PREFIX = "\u0000";
  /** This JVM's executor, looked up once: a host name lookup may be slow. */
  static final String EXECUTOR = executorId();
  static final int TOP_PAIRS_PER_GROUP = 3;

  /** Stage A's rows for stage B: the source's columns that B reads, control fields unpacked. */
  static final StructType STAGE_A_OUTPUT =
      new StructType()
          .add("kind", DataTypes.StringType)
          .add("a", DataTypes.StringType)
          .add("ra", DataTypes.StringType)
          .add("ia", DataTypes.IntegerType)
          .add("ea", DataTypes.StringType)
          .add("b", DataTypes.StringType)
          .add("rb", DataTypes.StringType)
          .add("n", DataTypes.LongType)
          .add("ts", DataTypes.TimestampType)
          .add("source_rk", DataTypes.StringType)
          .add("target_rk", DataTypes.StringType)
          .add("count", DataTypes.LongType)
          .add("state", DataTypes.StringType)
          .add("marker", DataTypes.LongType)
          .add("detail", DataTypes.StringType);

  /** {@code ROUTED_OUTPUT_SCHEMA} of {@code keyplane.spark.routed_counts}. */
  static final StructType OUTPUT =
      new StructType()
          .add("kind", DataTypes.StringType)
          .add("stage", DataTypes.StringType)
          .add("key", DataTypes.StringType)
          .add("routed_key", DataTypes.StringType)
          .add("instance", DataTypes.IntegerType)
          .add("count", DataTypes.LongType)
          .add("state", DataTypes.StringType)
          .add("target", DataTypes.StringType)
          .add("marker", DataTypes.LongType)
          .add("upstream", DataTypes.IntegerType)
          .add("n", DataTypes.LongType)
          .add("executor", DataTypes.StringType)
          .add("upstream_executor", DataTypes.StringType)
          .add("detail", DataTypes.StringType);

  /**
   * Routed-source rows to both stages' outputs, as {@code routed_running_counts} builds them in
   * Python. {@code inputs} carries a watermark on {@code ts} and, for every event, the routed key
   * of stage B in {@code rb}; {@code controlGroupsA[i]} is stage A's control group on instance i.
   */
  public static Dataset<Row> runningCounts(
      Dataset<Row> inputs, boolean tuples, List<String> controlGroupsA) {
    StructType stageAOutput =
        tuples ? STAGE_A_OUTPUT.add("pad", DataTypes.StringType) : STAGE_A_OUTPUT;
    int ra = inputs.schema().fieldIndex("ra");
    Dataset<Row> toStageB =
        inputs
            .groupByKey((MapFunction<Row, String>) row -> row.getString(ra), Encoders.STRING())
            .transformWithState(
                new StageA(tuples, controlGroupsA.toArray(new String[0])),
                "ts",
                OutputMode.Append(),
                Encoders.row(stageAOutput));
    int rb = stageAOutput.fieldIndex("rb");
    return toStageB
        .groupByKey((MapFunction<Row, String>) row -> row.getString(rb), Encoders.STRING())
        .transformWithState(
            new StageB(), TimeMode.None(), OutputMode.Append(), Encoders.row(OUTPUT));
  }

  /** A group's stored state: (encoded running count, tuples held, last marker installed). */
  record Held(long state, long count, long marker) {}

  /** A moved-in state: its source routed key, encoded state, count and marker. */
  record Install(String source, String state, long count, long marker) {}

  /** Where a stage's rows are read from: column positions, looked up once per schema. */
  static final class Columns {
    final int kind, a, b, ra, rb, ia, ea, n, ts, sourceRk, targetRk, count, state, marker, detail;
    final int pad;

    Columns(StructType schema) {
      kind = schema.fieldIndex("kind");
      a = schema.fieldIndex("a");
      b = schema.fieldIndex("b");
      ra = schema.fieldIndex("ra");
      rb = schema.fieldIndex("rb");
      ia = index(schema, "ia");
      ea = index(schema, "ea");
      n = schema.fieldIndex("n");
      ts = schema.fieldIndex("ts");
      sourceRk = schema.fieldIndex("source_rk");
      targetRk = schema.fieldIndex("target_rk");
      count = schema.fieldIndex("count");
      state = schema.fieldIndex("state");
      marker = schema.fieldIndex("marker");
      detail = schema.fieldIndex("detail");
      pad = index(schema, "pad");
    }

    private static int index(StructType schema, String name) {
      return schema.getFieldIndex(name).isDefined() ? schema.fieldIndex(name) : -1;
    }

    Install install(Row row) {
      return new Install(
          row.getString(sourceRk), row.getString(state), row.getLong(count), row.getLong(marker));
    }
  }

  /** What both stages share: the value state and the hand-off's install step (000 §3.4). */
  abstract static class Stage extends StatefulProcessor<String, Row, Row> {
    private transient ValueState<Tuple3<String, Long, Long>> stored;
    transient Columns columns;
    transient String executor;

    @Override
    public void init(OutputMode outputMode, TimeMode timeMode) {
      stored =
          getHandle()
              .getValueState(
                  "state",
                  Encoders.tuple(Encoders.STRING(), Encoders.LONG(), Encoders.LONG()),
                  TTLConfig.NONE());
      executor = EXECUTOR;
    }

    /**
     * A control group's rows each pass on as they are (reserved grouping values, see the routed
     * source's {@code control_group}); a routed key's rows go to {@link #handleGroup}.
     */
    @Override
    public final scala.collection.Iterator<Row> handleInputRows(
        String group, scala.collection.Iterator<Row> rows, TimerValues timerValues) {
      List<Row> out = new ArrayList<>();
      if (group.startsWith(CONTROL_PREFIX)) {
        while (rows.hasNext()) {
          out.add(control(rows.next()));
        }
      } else {
        handleGroup(group, rows, out);
      }
      return CollectionConverters.asScala(out.iterator());
    }

    /** A row of a control group, as it leaves this stage. */
    abstract Row control(Row row);

    /** A routed key's rows of one batch: its output rows go to {@code out}. */
    abstract void handleGroup(String group, scala.collection.Iterator<Row> rows, List<Row> out);

    Columns columns(Row row) {
      if (columns == null) {
        columns = new Columns(row.schema());
      }
      return columns;
    }

    Held held() {
      if (!stored.exists()) {
        return new Held(0, 0, -1);
      }
      Tuple3<String, Long, Long> value = stored.get();
      return new Held(Long.parseLong(value._1()), value._2(), value._3());
    }

    void store(Held held) {
      stored.update(new Tuple3<>(Long.toString(held.state()), held.count(), held.marker()));
    }

    void clear() {
      stored.clear();
    }

    /**
     * {@code held} with the new moved-in states merged in; {@code sources} receives the source
     * routed keys merged in, to tombstone. A marker at or below the installed one was installed
     * already (a replayed migration record); within one marker each source counts once (the
     * Python stages' {@code take_installs}).
     */
    static Held installed(Held held, List<Install> installs, List<String> sources) {
      Map<String, Install> taken = new TreeMap<>();
      long marker = held.marker();
      for (Install install : installs) {
        if (install.marker() <= held.marker() || taken.containsKey(install.source())) {
          continue;
        }
        taken.put(install.source(), install);
        marker = Math.max(marker, install.marker());
      }
      long state = held.state();
      long count = held.count();
      for (Install install : taken.values()) {
        state += Long.parseLong(install.state());
        count += install.count();
      }
      sources.addAll(taken.keySet());
      return new Held(state, count, marker);
    }
  }

  /** Stage A: the running count per routed key of field 1, sending its events on to stage B. */
  static final class StageA extends Stage {
    private final boolean tuples;
    private final String[] controlGroupsA;

    StageA(boolean tuples, String[] controlGroupsA) {
      this.tuples = tuples;
      this.controlGroupsA = controlGroupsA;
    }

    @Override
    void handleGroup(String group, scala.collection.Iterator<Row> rows, List<Row> out) {
      List<Install> installs = new ArrayList<>();
      List<Row> events = new ArrayList<>();
      Row evict = null;
      String keyA = null;
      String firstOther = null;
      while (rows.hasNext()) {
        Row row = rows.next();
        Columns c = columns(row);
        switch (row.getString(c.kind)) {
          case "install" -> {
            installs.add(c.install(row));
            keyA = keyA == null ? row.getString(c.a) : keyA;
          }
          case "event" -> events.add(row);
          case "evict" -> evict = evict == null ? row : evict;
          default -> throw new IllegalStateException("stage A: unknown row kind in " + row);
        }
        firstOther = firstOther == null ? row.getString(columns.a) : firstOther;
      }
      if (keyA == null) {
        keyA = events.isEmpty() ? firstOther : events.get(0).getString(columns.a);
      }
      int instance = TaskContext.getPartitionId();
      String reportGroup = controlGroupsA[instance];
      List<String> sources = new ArrayList<>();
      Held held = installed(held(), installs, sources);
      for (String source : sources) {
        out.add(report("report", keyA, source, null, 0, "0", reportGroup, null, null));
      }
      long added = 0;
      for (Row row : events) {
        added += row.getLong(columns.n);
      }
      long state = held.state() + added;
      long count = held.count() + added;
      String text = Long.toString(state);
      if (!installs.isEmpty() || !events.isEmpty()) {
        out.add(report("report", keyA, group, instance, count, text, reportGroup, null, null));
      }
      if (!events.isEmpty()) {
        toStageB(group, keyA, events, instance, out);
      }
      if (evict != null) {
        if (count > 0) {
          out.add(
              report(
                  "moved",
                  keyA,
                  group,
                  null,
                  count,
                  text,
                  reportGroup,
                  evict.getString(columns.targetRk),
                  evict.getLong(columns.marker)));
        }
        clear();
      } else if (!installs.isEmpty() || !events.isEmpty()) {
        store(new Held(state, count, held.marker()));
      }
    }

    /**
     * The batch's events as rows for stage B, on the routed key of B the source chose for each.
     * In {@code pairs} mode one row per (field-2 key, routed key of B) weighing {@code n}; in
     * {@code tuples} mode one row per tuple with its padding (000 §4.1).
     */
    private void toStageB(
        String group, String keyA, List<Row> events, int instance, List<Row> out) {
      Columns c = columns;
      Timestamp latest = null;
      for (Row row : events) {
        Timestamp ts = row.getTimestamp(c.ts);
        latest = latest == null || ts.after(latest) ? ts : latest;
      }
      if (tuples) {
        for (Row row : events) {
          out.add(
              eventRow(
                  keyA, group, instance, row.getString(c.b), row.getString(c.rb), 1, latest,
                  row.getString(c.pad)));
        }
        return;
      }
      Map<List<String>, Long> weights = new LinkedHashMap<>();
      for (Row row : events) {
        weights.merge(List.of(row.getString(c.b), row.getString(c.rb)), row.getLong(c.n), Long::sum);
      }
      for (Map.Entry<List<String>, Long> pair : weights.entrySet()) {
        List<String> key = pair.getKey();
        out.add(
            eventRow(keyA, group, instance, key.get(0), key.get(1), pair.getValue(), latest, null));
      }
    }

    private Row eventRow(
        String a, String ra, int ia, String b, String rb, long n, Timestamp ts, String pad) {
      Object[] values = {a, ra, ia, executor, b, rb, n, ts, null, null, null, null, null, null};
      return withKind("event", values, pad);
    }

    /** A {@code report} (a partial; zero for a tombstone) or {@code moved} row for the sink. */
    private Row report(
        String kind,
        String key,
        String routed,
        Integer instance,
        long count,
        String state,
        String reportGroup,
        String target,
        Long marker) {
      Object[] values = {
        key, routed, instance, null, null, reportGroup, null, null, null, target, count, state,
        marker, null
      };
      return withKind(kind, values, null);
    }

    /** A control row for stage B, or an invalid record: on to B in the group it names. */
    @Override
    Row control(Row row) {
      Columns c = columns(row);
      String rb = row.isNullAt(c.rb) ? row.getString(c.ra) : row.getString(c.rb);
      Object[] values = {
        row.getString(c.a),
        row.getString(c.ra),
        null,
        null,
        row.getString(c.b),
        rb,
        null,
        null,
        row.getString(c.sourceRk),
        row.getString(c.targetRk),
        row.isNullAt(c.count) ? null : row.getLong(c.count),
        row.getString(c.state),
        row.isNullAt(c.marker) ? null : row.getLong(c.marker),
        row.getString(c.detail)
      };
      return withKind(row.getString(c.kind), values, null);
    }

    private Row withKind(String kind, Object[] values, String pad) {
      Object[] row = new Object[values.length + (tuples ? 2 : 1)];
      row[0] = kind;
      System.arraycopy(values, 0, row, 1, values.length);
      if (tuples) {
        row[row.length - 1] = pad;
      }
      return RowFactory.create(row);
    }
  }

  /** Stage B: the running count per routed key of field 2, with the traffic it received. */
  static final class StageB extends Stage {
    @Override
    void handleGroup(String group, scala.collection.Iterator<Row> rows, List<Row> out) {
      List<Install> installs = new ArrayList<>();
      Row evict = null;
      String keyB = null;
      long added = 0;
      Map<List<Object>, Long> hops = new LinkedHashMap<>();
      Map<String, Long> pairs = new HashMap<>();
      List<String> pairOrder = new ArrayList<>();
      while (rows.hasNext()) {
        Row row = rows.next();
        Columns c = columns(row);
        keyB = keyB == null ? row.getString(c.b) : keyB;
        switch (row.getString(c.kind)) {
          case "event" -> {
            long n = row.getLong(c.n);
            String a = row.getString(c.a);
            added += n;
            hops.merge(Arrays.asList(row.getInt(c.ia), row.getString(c.ea)), n, Long::sum);
            if (pairs.merge(a, n, Long::sum) == n) {
              pairOrder.add(a);
            }
          }
          case "install" -> installs.add(c.install(row));
          case "evict" -> evict = row;
          default -> throw new IllegalStateException("stage B: unknown row kind in " + row);
        }
      }
      int instance = TaskContext.getPartitionId();
      List<String> sources = new ArrayList<>();
      Held held = installed(held(), installs, sources);
      long state = held.state() + added;
      long count = held.count() + added;
      String text = Long.toString(state);
      for (String source : sources) {
        out.add(output("count", "B", keyB, source, null, 0L, "0", null, null, null, null, null));
      }
      for (Map.Entry<List<Object>, Long> hop : hops.entrySet()) {
        List<Object> from = hop.getKey();
        out.add(
            output(
                "hop", null, null, null, instance, null, null, null, null, (Integer) from.get(0),
                hop.getValue(), (String) from.get(1)));
      }
      pairOrder.sort((x, y) -> Long.compare(pairs.get(y), pairs.get(x)));
      for (String a : pairOrder.subList(0, Math.min(TOP_PAIRS_PER_GROUP, pairOrder.size()))) {
        out.add(pairRow(keyB, a, instance, pairs.get(a)));
      }
      out.add(output("count", "B", keyB, group, instance, count, text, null, null, null, null, null));
      if (evict == null) {
        store(new Held(state, count, held.marker()));
      } else {
        if (count > 0) {
          out.add(
              output(
                  "moved", "B", keyB, group, null, count, text, evict.getString(columns.targetRk),
                  evict.getLong(columns.marker), null, null, null));
        }
        clear();
      }
    }

    private Row output(
        String kind,
        String stage,
        String key,
        String routedKey,
        Integer instance,
        Long count,
        String state,
        String target,
        Long marker,
        Integer upstream,
        Long n,
        String upstreamExecutor) {
      String where = "hop".equals(kind) ? executor : null;
      return RowFactory.create(
          kind, stage, key, routedKey, instance, count, state, target, marker, upstream, n, where,
          upstreamExecutor, null);
    }

    private static Row pairRow(String key, String a, int instance, long n) {
      return RowFactory.create(
          "pair", null, key, null, instance, null, null, null, null, null, n, null, null, a);
    }

    /** A stage-A report or an invalid record, as an output row. */
    @Override
    Row control(Row row) {
      Columns c = columns(row);
      String kind = row.getString(c.kind);
      if ("invalid".equals(kind)) {
        return RowFactory.create(
            "invalid", null, null, null, null, null, null, null, null, null, null, null, null,
            row.getString(c.detail));
      }
      String a = row.getString(c.a);
      String ra = row.getString(c.ra);
      long count = row.getLong(c.count);
      String state = row.getString(c.state);
      if ("report".equals(kind)) {
        Integer ia = row.isNullAt(c.ia) ? null : row.getInt(c.ia);
        return output("count", "A", a, ra, ia, count, state, null, null, null, null, null);
      }
      return output(
          "moved", "A", a, ra, null, count, state, row.getString(c.targetRk),
          row.getLong(c.marker), null, null, null);
    }
  }

  /**
   * This executor, as {@code host:directory}: the format of the Python stages' {@code
   * executor_id}, so that metrics read the same either way. An executor starts its Python
   * workers in its own working directory, which is this JVM's.
   */
  static String executorId() {
    String host;
    try {
      host = InetAddress.getLocalHost().getHostName();
    } catch (UnknownHostException e) {
      host = "unknown-host";
    }
    Path cwd = Paths.get("").toAbsolutePath().getFileName();
    return host + ":" + (cwd == null ? "" : cwd.toString());
  }
}
