package keyplane.spark.jvm;

import java.net.InetAddress;
import java.net.UnknownHostException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import com.fasterxml.jackson.core.JsonProcessingException;
import com.fasterxml.jackson.core.json.JsonWriteFeature;
import com.fasterxml.jackson.core.type.TypeReference;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.json.JsonMapper;
import org.apache.spark.TaskContext;
import org.apache.spark.api.java.function.MapFunction;
import org.apache.spark.sql.execution.streaming.operators.stateful.transformwithstate.statefulprocessor.ImplicitGroupingKeyTracker$;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.KeyValueGroupedDataset;
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
import org.apache.spark.unsafe.hash.Murmur3_x86_32;
import org.apache.spark.unsafe.types.UTF8String;
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
 * <p>Unlike the Python stages, a task writes some rows once for all its groups, in its first
 * closing group ({@link Stage#endOfTask}): stage A its events for B, one row per (field-2 key,
 * routed key of B) with their weights summed, and its heaviest pairs per B instance; stage B its
 * {@code hop} rows. Written per group, they would be a large share of B's input and most of the
 * rows collected.
 *
 * <p>A rollout's moves arrive per instance, not per routed key: one {@code installs} row in an
 * opening control group (it sorts before every routed key) and one {@code evicts} row in a
 * closing one (it sorts after), each holding a list of moves ({@code keyplane.spark.routed_source},
 * "per-instance" hand-offs). The group installs or evicts every listed routed key's state by
 * pointing the state store at that key ({@link #atKey}). A routed key's own group would cost a
 * group call for each moved key, twice per move; see {@link Stage#handleInputRows} for why the
 * order of the groups makes this exact.
 *
 * <p>Why a second implementation: PySpark serves each state call of a Python {@code
 * transformWithState} with a socket round trip to the executor's JVM, which dominates a Python
 * stage's cost per group, several times what a key of Spark's own count costs. In the JVM a
 * state call is a method call. Users' own aggregates keep running in Python; the running count,
 * whose state is a number, runs here.
 */
public final class RoutedStages {
  private RoutedStages() {}

  /** The reference pipeline's first stage, {@code keyplane.reference.pipeline.FIRST_STAGE}. */
  static final String FIRST_STAGE = "A";
  /** The reference pipeline's second stage, {@code keyplane.reference.pipeline.SECOND_STAGE}. */
  static final String SECOND_STAGE = "B";
  static final String CONTROL_PREFIX = "\u0000";
  /** U+10FFFF: grouping values that start with it sort after every routed key. */
  static final String CLOSING_PREFIX = "\uDBFF\uDFFF";
  /**
   * Writes non-ASCII as escapes, as Python's {@code json.dumps} does, so that a JSON text's length
   * is its size in bytes and a packed record keeps to {@link #MAX_RECORD_BYTES}.
   */
  static final ObjectMapper JSON =
      JsonMapper.builder().enable(JsonWriteFeature.ESCAPE_NON_ASCII).build();
  static final TypeReference<List<List<Object>>> MOVES = new TypeReference<>() {};
  /** {@code keyplane.kafka.migration_topic.MAX_RECORD_BYTES}: a packed record's budget. */
  static final int MAX_RECORD_BYTES = 256 * 1024;
  /** This JVM's executor, looked up once: a host name lookup may be slow. */
  static final String EXECUTOR = executorId();
  /**
   * {@code keyplane.algorithms.batchmetrics.TOP_PAIRS_PER_INSTANCE}: the heaviest pairs a stage-A task
   * reports per stage-B instance, as many as the metrics keep per instance.
   */
  static final int TOP_PAIRS_PER_INSTANCE = 5;

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
   * Python. {@code inputs} carry, for every event, the routed key of stage B in {@code rb};
   * {@code controlGroupsA[i]} is stage A's control group on instance i. Both stages run without a
   * time mode: neither sets a timer.
   */
  public static Dataset<Row> runningCounts(
      Dataset<Row> inputs, boolean tuples, List<String> controlGroupsA) {
    StructType stageAOutput =
        tuples ? STAGE_A_OUTPUT.add("pad", DataTypes.StringType) : STAGE_A_OUTPUT;
    int ra = inputs.schema().fieldIndex("ra");
    KeyValueGroupedDataset<String, Row> byRa =
        inputs.groupByKey(
            (MapFunction<Row, String>) row -> row.getString(ra), Encoders.STRING());
    StageA stageA = new StageA(tuples, controlGroupsA.toArray(new String[0]));
    Dataset<Row> toStageB =
        byRa.transformWithState(
            stageA, TimeMode.None(), OutputMode.Append(), Encoders.row(stageAOutput));
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
    final int kind, a, b, ra, rb, ia, ea, n, sourceRk, targetRk, count, state, marker;
    final int detail;
    /** The source's {@code stage} column; stage A's rows for B have none (-1). */
    final int stage;
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
      sourceRk = schema.fieldIndex("source_rk");
      targetRk = schema.fieldIndex("target_rk");
      count = schema.fieldIndex("count");
      state = schema.fieldIndex("state");
      marker = schema.fieldIndex("marker");
      detail = schema.fieldIndex("detail");
      stage = index(schema, "stage");
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

    /** Its stage's name: which of a rollout's {@code installs} and {@code evicts} rows are its. */
    abstract String name();

    /** Whether a routed key's group ran in this task: installs must come before any. */
    private transient boolean keysHandled;

    /** Whether this task evicted: no routed key's group may run after that. */
    private transient boolean evicted;

    /**
     * A routed key's rows go to {@link #handleGroup}. A control group's rows (reserved grouping
     * values, see the routed source's {@code control_group}) pass on as they are, except this
     * stage's own {@code installs} and {@code evicts}.
     *
     * <p>Why per-instance moves are exact (000 §3.4): Spark sorts a stateful operator's input by
     * grouping value and calls the groups of a task in that order. An opening group runs first,
     * so a moved-in state is in place before its key's first tuple adds to it; a closing group
     * runs last, so an evicted state holds every tuple of the switch batch. Should a Spark release
     * ever call the groups in another order, the task fails here rather than count wrong.
     */
    @Override
    public final scala.collection.Iterator<Row> handleInputRows(
        String group, scala.collection.Iterator<Row> rows, TimerValues timerValues) {
      List<Row> out = new ArrayList<>();
      boolean opening = group.startsWith(CONTROL_PREFIX);
      boolean closing = group.startsWith(CLOSING_PREFIX);
      if (!opening && !closing) {
        if (evicted) {
          throw outOfOrder(group);
        }
        keysHandled = true;
        handleGroup(group, rows, out);
        return CollectionConverters.asScala(out.iterator());
      }
      // A target's installs may come in several rows (one per migration record), and
      // installed() takes a marker once per call: so one call takes them all.
      List<List<Object>> installs = new ArrayList<>();
      Map<Long, List<List<Object>>> evictions = new TreeMap<>();
      while (rows.hasNext()) {
        Row row = rows.next();
        Columns c = columns(row);
        String kind = row.getString(c.kind);
        boolean mine = c.stage < 0 || name().equals(row.getString(c.stage));
        if (mine && "installs".equals(kind)) {
          if (!opening || keysHandled) {
            throw outOfOrder(group);
          }
          installs.addAll(moves(row.getString(c.state)));
        } else if (mine && "evicts".equals(kind)) {
          if (!closing) {
            throw outOfOrder(group);
          }
          evictions
              .computeIfAbsent(row.getLong(c.marker), m -> new ArrayList<>())
              .addAll(moves(row.getString(c.state)));
        } else {
          out.add(control(row));
        }
      }
      if (!installs.isEmpty()) {
        installAll(group, installs, out);
      }
      for (Map.Entry<Long, List<List<Object>>> batch : evictions.entrySet()) {
        evicted = true;
        evictAll(group, batch.getValue(), batch.getKey(), out);
      }
      if (closing) {
        endOfTask(out);
      }
      return CollectionConverters.asScala(out.iterator());
    }

    /**
     * The rows this task gathered over its routed keys' groups, written once, in its first
     * closing group: every routed key's group has run by then. The routed source sends a closing
     * row for each stage and instance with every batch of events ({@code batch_end_rows}), so
     * each task that saw an event reaches one.
     */
    abstract void endOfTask(List<Row> out);

    /** Whether rows gathered for {@link #endOfTask} are still unwritten. */
    abstract boolean gathering();

    /**
     * Spark closes the processor when the task's groups are done. Rows still gathered then
     * would be lost with the task's counts; fail the task instead (it is retried, and the
     * batch replays exactly).
     */
    @Override
    public void close() {
      if (gathering()) {
        throw new IllegalStateException(
            "stage "
                + name()
                + ": the task ended without its closing group, so the rows it gathered for the"
                + " next stage were never written (the routed source sends one with every batch)");
      }
    }

    private IllegalStateException outOfOrder(String group) {
      return new IllegalStateException(
          "stage "
              + name()
              + ": transformWithState called group "
              + group.replace(CLOSING_PREFIX, "<closing>").replace(CONTROL_PREFIX, "<opening>")
              + " out of grouping-value order; per-instance hand-offs need opening control groups"
              + " first and closing ones last (run the job with --stage-engine python)");
    }

    private static List<List<Object>> moves(String payload) {
      try {
        return JSON.readValue(payload, MOVES);
      } catch (JsonProcessingException e) {
        throw new IllegalArgumentException("a hand-off row's moves are not a JSON list", e);
      }
    }

    /** Points this task's state calls at {@code routedKey}'s group (Spark's own tracker). */
    static void atKey(String routedKey) {
      ImplicitGroupingKeyTracker$.MODULE$.setImplicitKey(routedKey);
    }

    /**
     * Installs a batch's moved-in states, {@code [key, source, target, count, state, marker]}
     * each, at their targets: as a routed key's group does with {@code install} rows, one target
     * at a time. The tombstones and partials they report leave as one {@code partials} row
     * ({@link #partials}) rather than a row each through stage B and the sink.
     */
    private void installAll(String group, List<List<Object>> moves, List<Row> out) {
      Map<String, List<Install>> byTarget = new LinkedHashMap<>();
      Map<String, String> keyOf = new HashMap<>();
      for (List<Object> move : moves) {
        String target = (String) move.get(2);
        keyOf.put(target, (String) move.get(0));
        byTarget
            .computeIfAbsent(target, t -> new ArrayList<>())
            .add(
                new Install(
                    (String) move.get(1),
                    (String) move.get(4),
                    ((Number) move.get(3)).longValue(),
                    ((Number) move.get(5)).longValue()));
      }
      int instance = TaskContext.getPartitionId();
      List<List<Object>> reported = new ArrayList<>();
      try {
        for (Map.Entry<String, List<Install>> entry : byTarget.entrySet()) {
          String target = entry.getKey();
          String key = keyOf.get(target);
          atKey(target);
          List<String> sources = new ArrayList<>();
          Held held = installed(held(), entry.getValue(), sources);
          if (sources.isEmpty()) {
            continue;
          }
          store(held);
          for (String source : sources) {
            reported.add(Arrays.asList(name(), key, source, null, 0L, "0"));
          }
          reported.add(
              Arrays.asList(
                  name(), key, target, instance, held.count(), Long.toString(held.state())));
        }
      } finally {
        atKey(group);
      }
      if (!reported.isEmpty()) {
        out.add(partials(json(reported), reported.size()));
      }
    }

    static String json(Object value) {
      try {
        return JSON.writeValueAsString(value);
      } catch (JsonProcessingException e) {
        throw new IllegalStateException("cannot write a hand-off's JSON", e);
      }
    }

    /**
     * Evicts a switch batch's moved-out states, {@code [key, source, target]} each: as a routed
     * key's group does with an {@code evict} row, after every tuple of the batch has counted. The
     * states leave as {@code moves} rows, each a migration-topic record ({@code
     * keyplane.kafka.migration_topic}) that the sink sends as it is.
     */
    private void evictAll(String group, List<List<Object>> moves, long marker, List<Row> out) {
      Set<String> done = new HashSet<>();
      List<String> record = new ArrayList<>();
      int size = 0;
      try {
        for (List<Object> move : moves) {
          String source = (String) move.get(1);
          if (!done.add(source)) {
            continue;
          }
          atKey(source);
          Held held = held();
          if (held.count() > 0) {
            Map<String, Object> moved = new LinkedHashMap<>();
            moved.put("operator", name());
            moved.put("key", move.get(0));
            moved.put("source", source);
            moved.put("target", move.get(2));
            moved.put("count", held.count());
            moved.put("state", Long.toString(held.state()));
            moved.put("marker", marker);
            String text = json(moved);
            if (!record.isEmpty() && size + text.length() > MAX_RECORD_BYTES) {
              out.add(movesRow(record));
              record = new ArrayList<>();
              size = 0;
            }
            record.add(text);
            size += text.length() + 1;
          }
          clear();
        }
      } finally {
        atKey(group);
      }
      if (!record.isEmpty()) {
        out.add(movesRow(record));
      }
    }

    private Row movesRow(List<String> record) {
      return moves("{\"moves\":[" + String.join(",", record) + "]}", record.size());
    }

    /** A migration-topic record of {@code n} moved states, for the sink to send as it is. */
    abstract Row moves(String record, long n);

    /** {@code n} reports ([stage, key, routed key, instance, count, state] each), as one row. */
    abstract Row partials(String reports, long n);

    /** The zero a routed key reports once its state moved into another (never counted twice). */
    abstract Row tombstone(String key, String source, int instance);

    /** A routed key's partial: the tuples it holds and its encoded state. */
    abstract Row partial(String key, String routed, int instance, Held held);

    /** A routed key's state on its way to {@code target}, for the migration topic. */
    abstract Row moved(String key, String routed, int instance, Held held, String target, long marker);

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

    /** The group's state, or the empty one: one state-store lookup ({@code get} is null if none). */
    Held held() {
      Tuple3<String, Long, Long> value = stored.get();
      if (value == null) {
        return new Held(0, 0, -1);
      }
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

    /**
     * This task's events for stage B in {@code pairs} mode, per (field-2 key, routed key of B):
     * the weights of all its groups summed, so that each leaves as one row ({@link #endOfTask}).
     */
    private transient Map<List<String>, Long> forB;

    /** This task's (field-1 key, field-2 key, routed key of B) pairs and their weights. */
    private transient Map<List<String>, Long> pairs;

    StageA(boolean tuples, String[] controlGroupsA) {
      this.tuples = tuples;
      this.controlGroupsA = controlGroupsA;
    }

    @Override
    public void init(OutputMode outputMode, TimeMode timeMode) {
      super.init(outputMode, timeMode);
      forB = new LinkedHashMap<>();
      pairs = new HashMap<>();
    }

    @Override
    boolean gathering() {
      return !forB.isEmpty() || !pairs.isEmpty();
    }

    /**
     * The task's events for B, one row per (field-2 key, routed key of B), and the heaviest pairs
     * per stage-B instance, which B passes on to the sink as {@code pair} rows.
     *
     * <p>Why here and not in B: B would need every (field-1 key, field-2 key) pair to rank them,
     * one row each across the shuffle: close to half of B's input on the geo-tags stream. A
     * routed key of field 1 runs in one task, so a task's pair weights are whole unless the key
     * is split, and an instance's heaviest pairs are among its tasks' heaviest.
     */
    @Override
    void endOfTask(List<Row> out) {
      int instance = TaskContext.getPartitionId();
      for (Map.Entry<List<String>, Long> row : forB.entrySet()) {
        List<String> key = row.getKey();
        out.add(
            eventRow(null, null, instance, key.get(0), key.get(1), row.getValue(), null));
      }
      Map<Integer, List<Map.Entry<List<String>, Long>>> byInstanceB = new TreeMap<>();
      for (Map.Entry<List<String>, Long> pair : pairs.entrySet()) {
        int instanceB = partition(pair.getKey().get(2), controlGroupsA.length);
        byInstanceB.computeIfAbsent(instanceB, i -> new ArrayList<>()).add(pair);
      }
      for (Map.Entry<Integer, List<Map.Entry<List<String>, Long>>> one : byInstanceB.entrySet()) {
        List<Map.Entry<List<String>, Long>> ranked = one.getValue();
        ranked.sort((x, y) -> Long.compare(y.getValue(), x.getValue()));
        for (Map.Entry<List<String>, Long> pair :
            ranked.subList(0, Math.min(TOP_PAIRS_PER_INSTANCE, ranked.size()))) {
          List<String> key = pair.getKey();
          Object[] values = {
            key.get(0), null, instance, executor, key.get(1), controlGroupsA[one.getKey()],
            pair.getValue(), null, null, null, null, null, null
          };
          out.add(withKind("pair", values, null));
        }
      }
      forB.clear();
      pairs.clear();
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
      List<String> sources = new ArrayList<>();
      Held held = installed(held(), installs, sources);
      for (String source : sources) {
        out.add(tombstone(keyA, source, instance));
      }
      long added = 0;
      for (Row row : events) {
        added += row.getLong(columns.n);
      }
      Held now = new Held(held.state() + added, held.count() + added, held.marker());
      if (!installs.isEmpty() || !events.isEmpty()) {
        out.add(partial(keyA, group, instance, now));
      }
      if (!events.isEmpty()) {
        toStageB(group, keyA, events, instance, out);
      }
      if (evict != null) {
        if (now.count() > 0) {
          out.add(
              moved(
                  keyA,
                  group,
                  instance,
                  now,
                  evict.getString(columns.targetRk),
                  evict.getLong(columns.marker)));
        }
        clear();
      } else if (!installs.isEmpty() || !events.isEmpty()) {
        store(now);
      }
    }

    @Override
    String name() {
      return FIRST_STAGE;
    }

    @Override
    Row tombstone(String key, String source, int instance) {
      return report("report", key, source, null, 0, "0", controlGroupsA[instance], null, null);
    }

    @Override
    Row partial(String key, String routed, int instance, Held held) {
      String text = Long.toString(held.state());
      return report(
          "report", key, routed, instance, held.count(), text, controlGroupsA[instance], null, null);
    }

    @Override
    Row moved(String key, String routed, int instance, Held held, String target, long marker) {
      String text = Long.toString(held.state());
      return report(
          "moved", key, routed, null, held.count(), text, controlGroupsA[instance], target, marker);
    }

    @Override
    Row moves(String record, long n) {
      int instance = TaskContext.getPartitionId();
      return report("moves", null, null, null, n, record, controlGroupsA[instance], null, null);
    }

    @Override
    Row partials(String reports, long n) {
      int instance = TaskContext.getPartitionId();
      return report("partials", null, null, null, n, reports, controlGroupsA[instance], null, null);
    }

    /**
     * The batch's events as rows for stage B, on the routed key of B the source chose for each.
     * In {@code pairs} mode one row per (field-2 key, routed key of B) weighing {@code n}; in
     * {@code tuples} mode one row per tuple with its padding (000 §4.1).
     */
    private void toStageB(
        String group, String keyA, List<Row> events, int instance, List<Row> out) {
      Columns c = columns;
      for (Row row : events) {
        String b = row.getString(c.b);
        String rb = row.getString(c.rb);
        long n = tuples ? 1 : row.getLong(c.n);
        pairs.merge(List.of(keyA, b, rb), n, Long::sum);
        if (tuples) {
          out.add(eventRow(keyA, group, instance, b, rb, 1, row.getString(c.pad)));
        } else {
          forB.merge(List.of(b, rb), n, Long::sum);
        }
      }
    }

    private Row eventRow(
        String a, String ra, int ia, String b, String rb, long n, String pad) {
      Object[] values = {a, ra, ia, executor, b, rb, n, null, null, null, null, null, null};
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
        key, routed, instance, null, null, reportGroup, null, null, target, count, state, marker,
        null
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
    /** This task's tuples per stage-A instance and executor they came from, for {@code hop} rows. */
    private transient Map<List<Object>, Long> hops;

    @Override
    public void init(OutputMode outputMode, TimeMode timeMode) {
      super.init(outputMode, timeMode);
      hops = new LinkedHashMap<>();
    }

    @Override
    boolean gathering() {
      return !hops.isEmpty();
    }

    /** The task's traffic from stage A: one {@code hop} row per upstream instance and executor. */
    @Override
    void endOfTask(List<Row> out) {
      int instance = TaskContext.getPartitionId();
      for (Map.Entry<List<Object>, Long> hop : hops.entrySet()) {
        List<Object> from = hop.getKey();
        out.add(
            output(
                "hop", null, null, null, instance, null, null, null, null, (Integer) from.get(0),
                hop.getValue(), (String) from.get(1)));
      }
      hops.clear();
    }

    @Override
    void handleGroup(String group, scala.collection.Iterator<Row> rows, List<Row> out) {
      List<Install> installs = new ArrayList<>();
      Row evict = null;
      String keyB = null;
      long added = 0;
      while (rows.hasNext()) {
        Row row = rows.next();
        Columns c = columns(row);
        keyB = keyB == null ? row.getString(c.b) : keyB;
        switch (row.getString(c.kind)) {
          case "event" -> {
            long n = row.getLong(c.n);
            added += n;
            hops.merge(Arrays.asList(row.getInt(c.ia), row.getString(c.ea)), n, Long::sum);
          }
          case "install" -> installs.add(c.install(row));
          case "evict" -> evict = row;
          default -> throw new IllegalStateException("stage B: unknown row kind in " + row);
        }
      }
      int instance = TaskContext.getPartitionId();
      List<String> sources = new ArrayList<>();
      Held held = installed(held(), installs, sources);
      Held now = new Held(held.state() + added, held.count() + added, held.marker());
      for (String source : sources) {
        out.add(tombstone(keyB, source, instance));
      }
      out.add(partial(keyB, group, instance, now));
      if (evict == null) {
        store(now);
      } else {
        if (now.count() > 0) {
          out.add(
              moved(
                  keyB, group, instance, now, evict.getString(columns.targetRk),
                  evict.getLong(columns.marker)));
        }
        clear();
      }
    }

    @Override
    String name() {
      return SECOND_STAGE;
    }

    @Override
    Row tombstone(String key, String source, int instance) {
      return output(
          "count", SECOND_STAGE, key, source, null, 0L, "0", null, null, null, null, null);
    }

    @Override
    Row partial(String key, String routed, int instance, Held held) {
      String text = Long.toString(held.state());
      return output(
          "count", SECOND_STAGE, key, routed, instance, held.count(), text, null, null, null, null,
          null);
    }

    @Override
    Row moved(String key, String routed, int instance, Held held, String target, long marker) {
      String text = Long.toString(held.state());
      return output(
          "moved", SECOND_STAGE, key, routed, null, held.count(), text, target, marker, null, null,
          null);
    }

    @Override
    Row moves(String record, long n) {
      return output(
          "moves", SECOND_STAGE, null, null, null, n, record, null, null, null, null, null);
    }

    @Override
    Row partials(String reports, long n) {
      return output(
          "partials", SECOND_STAGE, null, null, null, n, reports, null, null, null, null, null);
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
      if ("pair".equals(kind)) {
        // A stage-A task's heaviest pairs of this instance (StageA#endOfTask), for the sink.
        return pairRow(
            row.getString(c.b), row.getString(c.a), TaskContext.getPartitionId(), row.getLong(c.n));
      }
      String a = row.getString(c.a);
      String ra = row.getString(c.ra);
      long count = row.getLong(c.count);
      String state = row.getString(c.state);
      if ("moves".equals(kind) || "partials".equals(kind)) {
        return output(
            kind, FIRST_STAGE, null, null, null, count, state, null, null, null, null, null);
      }
      if ("report".equals(kind)) {
        Integer ia = row.isNullAt(c.ia) ? null : row.getInt(c.ia);
        return output("count", FIRST_STAGE, a, ra, ia, count, state, null, null, null, null, null);
      }
      return output(
          "moved", FIRST_STAGE, a, ra, null, count, state, row.getString(c.targetRk),
          row.getLong(c.marker), null, null, null);
    }
  }

  /** One group call of {@link #probe}: the group, its task's partition and call index. */
  static final StructType PROBE_OUTPUT =
      new StructType()
          .add("group", DataTypes.StringType)
          .add("partition", DataTypes.IntegerType)
          .add("call", DataTypes.IntegerType)
          .add("redirected", DataTypes.BooleanType);

  /**
   * What the stages rely on in Spark, observed with the stages' own operator on {@code values}
   * (a column {@code value}): which partition each grouping value lands on, in which order a
   * task calls its groups, and whether {@link Stage#atKey} points the state calls at another key.
   * {@code keyplane.spark.jvm.spark_behaviour_problems} checks the rows when the job starts.
   */
  public static Dataset<Row> probe(Dataset<Row> values) {
    int value = values.schema().fieldIndex("value");
    return values
        .groupByKey((MapFunction<Row, String>) row -> row.getString(value), Encoders.STRING())
        .transformWithState(
            new Probe(), TimeMode.None(), OutputMode.Append(), Encoders.row(PROBE_OUTPUT));
  }

  /** The processor of {@link #probe}. */
  static final class Probe extends StatefulProcessor<String, Row, Row> {
    private transient ValueState<Long> state;
    private transient int calls;

    @Override
    public void init(OutputMode outputMode, TimeMode timeMode) {
      state = getHandle().getValueState("probe", Encoders.LONG(), TTLConfig.NONE());
    }

    @Override
    public scala.collection.Iterator<Row> handleInputRows(
        String group, scala.collection.Iterator<Row> rows, TimerValues timerValues) {
      while (rows.hasNext()) {
        rows.next();
      }
      state.update(1L);
      boolean redirected;
      try {
        Stage.atKey(group + "\u0002probe");
        redirected = state.get() == null;
        state.update(2L);
        redirected = redirected && state.get() == 2L;
        state.clear();
      } finally {
        Stage.atKey(group);
      }
      redirected = redirected && state.get() == 1L;
      state.clear();
      Row row = RowFactory.create(group, TaskContext.getPartitionId(), calls++, redirected);
      return CollectionConverters.asScala(List.of(row).iterator());
    }
  }

  /**
   * The partition Spark's {@code HashPartitioning} gives a string grouping value: {@code
   * pmod(murmur3(value, 42), n)}, as {@code keyplane.routing.routedkeys.spark_partition} computes it.
   */
  static int partition(String value, int n) {
    UTF8String s = UTF8String.fromString(value);
    int hash =
        Murmur3_x86_32.hashUnsafeBytes(s.getBaseObject(), s.getBaseOffset(), s.numBytes(), 42);
    return Math.floorMod(hash, n);
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
