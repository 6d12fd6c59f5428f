package keyplane.spark.jvm;

import java.io.IOException;
import java.io.Serializable;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.math.BigInteger;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collections;
import java.util.HashMap;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.StreamReadConstraints;
import com.fasterxml.jackson.core.json.JsonReadFeature;
import com.fasterxml.jackson.databind.DeserializationFeature;
import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.json.JsonMapper;
import org.apache.spark.TaskContext;
import org.apache.spark.api.java.function.MapPartitionsFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.types.StructType;

/**
 * The routed job's events as Spark's Kafka connector reads them, parsed, validated, routed and
 * combined in the JVM: the rows {@code keyplane.spark.routed_reads.route_events} writes in
 * {@code pairs} mode, with no Python per record.
 *
 * <p>A task finds its batch's routing where the Python router finds it ({@code
 * keyplane.spark.batch_plan}): the batch id Spark sets on a micro-batch's tasks, and that batch's
 * line of keyplane's source in Spark's offset log, which Spark writes before the batch runs and
 * reads back to replay it. So a replayed batch routes on the versions it first routed on (000
 * §3.4). Each version's routed-key table is a file the driver wrote once, when it first planned a
 * batch on that version ({@code keyplane.routing.exported_tables}): the salts are searched in
 * Python, once; here a key is looked up, or takes the hash fallback (000 §3.3), folded onto the
 * active instances when the stage is scaled in (003 §5.3).
 *
 * <p>A hot key's events take the least loaded of its routes by this task's own counts, in offset
 * order (001 §4.1.2), and the task's events are combined per (routed key, field-1 key, field-2
 * key), as Spark's partial aggregation combines its input partition; each pair's stage-B route is
 * picked heaviest first. A record that is not a valid event becomes an {@code invalid} row with
 * the reason {@code keyplane.reference.events.parse_event} gives it, so it is dead-lettered and
 * never lost.
 */
public final class RoutedEvents {
  private RoutedEvents() {}

  /** {@code keyplane.spark.batch_plan.BATCH_ID_PROPERTY}. */
  static final String BATCH_ID_PROPERTY = "streaming.sql.batchId";
  /** {@code keyplane.routing.routedkeys.SEPARATOR}. */
  static final String SEPARATOR = "#";
  /** {@code keyplane.routing.routedkeys.ESCAPE}. */
  static final String ESCAPE = "\u0001";
  /** {@code keyplane.routing.routedkeys.TRIES_PER_PARTITION}. */
  static final int TRIES_PER_PARTITION = 64;
  /** {@code keyplane.reference.events.MAX_NESTING_DEPTH}. */
  static final int MAX_NESTING_DEPTH = 256;
  /** {@code keyplane.reference.events.DEAD_LETTER_VALUE_BYTES}. */
  static final int DEAD_LETTER_VALUE_BYTES = 1024;
  /** Epoch milliseconds of 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z. */
  static final long TS_MIN_MS = -62135596800000L;
  static final long TS_MAX_MS = 253402300799999L;
  /** Versions whose tables an executor keeps, as {@code keyplane.routing.handoff.KEPT_VERSIONS}. */
  static final int KEPT_VERSIONS = 4;
  /** Hash-fallback values a scaled-in table keeps, {@code keyplane.routing.routedkeys.FOLDS_KEPT}. */
  static final int FOLDS_KEPT = 1 << 15;

  /**
   * Reads JSON as Python's {@code json.loads} does where it matters to a verdict: the last of
   * duplicate names wins, {@code NaN} and {@code Infinity} are numbers, and nothing may follow the
   * value. Numbers of any length are read (Python reads them too), and the nesting is checked
   * before parsing ({@link #nestedDeeperThan}).
   */
  static final ObjectMapper READER =
      JsonMapper.builder(
              JsonFactory.builder()
                  .streamReadConstraints(
                      StreamReadConstraints.builder()
                          .maxNumberLength(Integer.MAX_VALUE)
                          .maxStringLength(Integer.MAX_VALUE)
                          .maxNestingDepth(MAX_NESTING_DEPTH + 1)
                          .build())
                  .build())
          .enable(JsonReadFeature.ALLOW_NON_NUMERIC_NUMBERS)
          .enable(DeserializationFeature.FAIL_ON_TRAILING_TOKENS)
          .enable(DeserializationFeature.USE_BIG_INTEGER_FOR_INTS)
          .build();

  /** The rows, {@code routed_input_schema("pairs")} with {@code ts} in epoch microseconds. */
  static final StructType OUTPUT =
      StructType.fromDDL(
          "kind STRING, stage STRING, seq LONG, a STRING, b STRING, ts LONG, ra STRING, "
              + "rb STRING, vb INT, source_rk STRING, target_rk STRING, count LONG, "
              + "state STRING, marker LONG, detail STRING, n LONG");

  /**
   * The connector's records ({@code topic}, {@code partition}, {@code offset}, {@code value})
   * routed on each batch's plan; {@code settings} is the JSON of {@code
   * keyplane.spark.connector_events.ConnectorEventsRouter.jvm_settings}.
   */
  public static Dataset<Row> route(Dataset<Row> records, String settings) throws IOException {
    Settings s = Settings.parse(settings);
    return records.mapPartitions(new Router(s), Encoders.row(OUTPUT));
  }

  /** What every task routes by, beside its batch's versions. */
  static final class Settings implements Serializable {
    private static final long serialVersionUID = 1L;
    String checkpoint;
    String store;
    int parallelism;
    long maxEventBytes;
    /** (field-1 key, field-2 key) → reason, of the quarantined pairs. */
    Map<List<String>, String> quarantine = new HashMap<>();
    /** {@code control_groups("I", P)}: a dead letter travels in its source's group. */
    List<String> invalidGroups = new ArrayList<>();
    /** (stage, group) of {@code batch_end_rows}, sent first by every task; empty per key. */
    List<List<String>> batchEnd = new ArrayList<>();

    static Settings parse(String json) throws IOException {
      JsonNode root = READER.readTree(json);
      Settings s = new Settings();
      s.checkpoint = root.get("checkpoint").asText();
      s.store = root.get("store").asText();
      s.parallelism = root.get("parallelism").asInt();
      s.maxEventBytes = root.get("max_event_bytes").asLong();
      for (JsonNode q : root.get("quarantine")) {
        s.quarantine.put(List.of(q.get(0).asText(), q.get(1).asText()), q.get(2).asText());
      }
      for (JsonNode g : root.get("invalid_groups")) {
        s.invalidGroups.add(g.asText());
      }
      for (JsonNode row : root.get("batch_end")) {
        s.batchEnd.add(List.of(row.get(0).asText(), row.get(1).asText()));
      }
      return s;
    }
  }

  /** One task: its batch's plan, then its records in order. */
  static final class Router implements MapPartitionsFunction<Row, Row> {
    private static final long serialVersionUID = 1L;
    private final Settings settings;

    Router(Settings settings) {
      this.settings = settings;
    }

    @Override
    public Iterator<Row> call(Iterator<Row> records) throws Exception {
      long batch = runningBatchId();
      JsonNode plan = plannedOffset(settings.checkpoint, batch);
      JsonNode versions = plan.get("routing");
      int versionA = versions.get(RoutedStages.FIRST_STAGE).asInt();
      int versionB = versions.get(RoutedStages.SECOND_STAGE).asInt();
      int n = settings.parallelism;
      Table tableA = Table.of(settings.store, versionA, n).get(RoutedStages.FIRST_STAGE);
      Table tableB = Table.of(settings.store, versionB, n).get(RoutedStages.SECOND_STAGE);
      JsonNode prepared = plan.get("prepared");
      if (prepared != null && prepared.canConvertToInt()) {
        // 000 §3.4: an instance that acknowledges a PREPARE holds the new configuration.
        // Loading it in the batches before the switch keeps its cost out of the switch and
        // install batches, as the Python router does; once the driver has written it.
        Table.preload(settings.store, prepared.asInt(), settings.parallelism);
      }
      List<Row> out = new ArrayList<>();
      for (List<String> end : settings.batchEnd) {
        String stage = end.get(0);
        String group = end.get(1);
        String rb = stage.equals(RoutedStages.SECOND_STAGE) ? group : null;
        out.add(control("evicts", stage, group, rb, "[]", -1L, null));
      }
      LeastLoaded toA = new LeastLoaded(tableA);
      Map<List<String>, long[]> pairs = new LinkedHashMap<>();
      while (records.hasNext()) {
        Row record = records.next();
        byte[] value = record.isNullAt(3) ? null : (byte[]) record.get(3);
        Parsed event = parse(value, settings.maxEventBytes);
        if (event.reason == null && !settings.quarantine.isEmpty()) {
          event.reason = settings.quarantine.get(List.of(event.a, event.b));
        }
        String source = record.getString(0) + "[" + record.getInt(1) + "]";
        if (event.reason != null) {
          String group =
              settings.invalidGroups.get(RoutedStages.partition(source, settings.parallelism));
          String detail = deadLetter(source, record.getLong(2), event.reason, value);
          out.add(control("invalid", null, group, null, null, null, detail));
          continue;
        }
        String ra = toA.pick(tableA.route(event.a), 1);
        long[] pair =
            pairs.computeIfAbsent(List.of(ra, event.a, event.b), k -> new long[] {0, Long.MIN_VALUE});
        pair[0] += 1;
        pair[1] = Math.max(pair[1], event.ts);
      }
      LeastLoaded toB = new LeastLoaded(tableB);
      List<Map.Entry<List<String>, long[]>> rows = new ArrayList<>(pairs.entrySet());
      String[] rb = new String[rows.size()];
      List<List<String>> routesB = new ArrayList<>(rows.size());
      List<Integer> split = new ArrayList<>();
      for (int i = 0; i < rows.size(); i++) {
        List<String> routes = tableB.route(rows.get(i).getKey().get(2));
        routesB.add(routes);
        if (routes.size() == 1) {
          rb[i] = toB.pick(routes, rows.get(i).getValue()[0]);
        } else {
          split.add(i);
        }
      }
      // Heaviest first (longest processing time first), ties in the rows' order.
      split.sort((i, j) -> Long.compare(rows.get(j).getValue()[0], rows.get(i).getValue()[0]));
      for (int i : split) {
        rb[i] = toB.pick(routesB.get(i), rows.get(i).getValue()[0]);
      }
      for (int i = 0; i < rows.size(); i++) {
        List<String> key = rows.get(i).getKey();
        long[] counts = rows.get(i).getValue();
        out.add(
            RowFactory.create(
                "event", null, null, key.get(1), key.get(2), counts[1] * 1000L, key.get(0), rb[i],
                versionB, null, null, null, null, null, null, counts[0]));
      }
      return out.iterator();
    }
  }

  /** A row of {@link #OUTPUT} that carries no event: a batch's closing row, a dead letter. */
  static Row control(
      String kind, String stage, String ra, String rb, String state, Long marker, String detail) {
    return RowFactory.create(
        kind, stage, null, null, null, null, ra, rb, null, null, null, null, state, marker, detail,
        null);
  }

  /** The id of the micro-batch the calling task runs in. */
  static long runningBatchId() {
    TaskContext context = TaskContext.get();
    String value = context == null ? null : context.getLocalProperty(BATCH_ID_PROPERTY);
    if (value == null) {
      throw new IllegalStateException(
          "not in a task of a streaming query's micro-batch: Spark sets no '"
              + BATCH_ID_PROPERTY
              + "' here");
    }
    return Long.parseLong(value);
  }

  /** {@code keyplane.spark.batch_plan.planned_offset}: keyplane's line of the batch's offset log. */
  static JsonNode plannedOffset(String checkpoint, long batch) throws IOException {
    Path file = Paths.get(checkpoint, "offsets", Long.toString(batch));
    List<String> lines;
    try {
      lines = Files.readAllLines(file, StandardCharsets.UTF_8);
    } catch (IOException e) {
      throw new IOException(
          "batch " + batch + ": Spark's offset log " + file + " cannot be read (" + e
              + "); the executors must see the query's checkpoint", e);
    }
    for (String line : lines.subList(Math.min(2, lines.size()), lines.size())) {
      if (!line.startsWith("{")) {
        continue;
      }
      JsonNode offset = READER.readTree(line);
      if (offset.has("routing") && offset.has("protocol")) {
        return offset;
      }
    }
    throw new IOException(
        "batch " + batch + ": " + file + " holds no offset of keyplane's routed source; is the "
            + "query reading one?");
  }

  /** {@code json.dumps} of a dead letter's detail: where the record was, why, and its value. */
  static String deadLetter(String source, long offset, String reason, byte[] value)
      throws IOException {
    Map<String, Object> detail = new LinkedHashMap<>();
    detail.put("source", source);
    detail.put("offset", offset);
    detail.put("reason", reason);
    byte[] raw = value == null ? new byte[0] : value;
    byte[] kept = java.util.Arrays.copyOf(raw, Math.min(raw.length, DEAD_LETTER_VALUE_BYTES));
    if (strictUtf8(raw) == null) {
      detail.put("value_base64", Base64.getEncoder().encodeToString(kept));
    } else {
      // Valid UTF-8 cut at the limit may end inside a character: that piece is dropped,
      // as Python's decode(..., "ignore") drops it.
      detail.put("value", decodeUtf8(kept, CodingErrorAction.IGNORE));
    }
    return RoutedStages.JSON.writeValueAsString(detail);
  }

  /** An event's fields, or why its record is not one. */
  static final class Parsed {
    String a;
    String b;
    long ts;
    String reason;

    static Parsed refused(String reason) {
      Parsed p = new Parsed();
      p.reason = reason;
      return p;
    }
  }

  /**
   * {@code keyplane.reference.events.parse_event}: the one definition of a valid event, with the
   * same reasons, checked in the same order (size, strict UTF-8, nesting, JSON, surrogates,
   * schema, ranges). A "not JSON" reason names the parser's own complaint after the colon.
   */
  static Parsed parse(byte[] value, long maxBytes) {
    if (value == null) {
      return Parsed.refused("empty record");
    }
    if (value.length > maxBytes) {
      return Parsed.refused("oversized: " + value.length + " bytes > " + maxBytes);
    }
    String text = strictUtf8(value);
    if (text == null) {
      return Parsed.refused("not JSON: the value is not UTF-8");
    }
    if (nestedDeeperThan(value, MAX_NESTING_DEPTH)) {
      return Parsed.refused("not JSON: nested deeper than " + MAX_NESTING_DEPTH);
    }
    JsonNode event;
    try {
      event = READER.readTree(text);
    } catch (IOException e) {
      String message = e.getMessage() == null ? e.toString() : e.getMessage().split("\n")[0];
      return Parsed.refused("not JSON: " + message);
    }
    if (event == null || event.isMissingNode()) {
      return Parsed.refused("not JSON: Expecting value");
    }
    if (text.contains("\\u") && holdsLoneSurrogate(event)) {
      return Parsed.refused(
          "not JSON: a string holds an unpaired surrogate escape, which UTF-8 cannot encode");
    }
    if (!event.isObject()) {
      return Parsed.refused("schema: not a JSON object");
    }
    JsonNode seq = event.get("seq");
    JsonNode a = event.get("a");
    JsonNode b = event.get("b");
    JsonNode ts = event.get("ts");
    if (seq == null || !seq.isIntegralNumber()) {
      return Parsed.refused("schema: field 'seq' missing or not int");
    }
    if (a == null || !a.isTextual()) {
      return Parsed.refused("schema: field 'a' missing or not str");
    }
    if (b == null || !b.isTextual()) {
      return Parsed.refused("schema: field 'b' missing or not str");
    }
    if (ts == null || !ts.isIntegralNumber()) {
      return Parsed.refused("schema: field 'ts' missing or not int");
    }
    if (!fitsLong(seq.bigIntegerValue())) {
      return Parsed.refused("schema: field 'seq' out of range: not a 64-bit integer");
    }
    BigInteger millis = ts.bigIntegerValue();
    if (!fitsLong(millis) || millis.longValue() < TS_MIN_MS || millis.longValue() > TS_MAX_MS) {
      return Parsed.refused(
          "schema: field 'ts' out of range: not epoch milliseconds in years 1 to 9999");
    }
    Parsed p = new Parsed();
    p.a = a.textValue();
    p.b = b.textValue();
    p.ts = millis.longValue();
    return p;
  }

  static boolean fitsLong(BigInteger value) {
    return value.bitLength() <= 63;
  }

  /** The value as text when it is strict UTF-8 (no overlong forms, no encoded surrogates). */
  static String strictUtf8(byte[] value) {
    try {
      return decodeUtf8(value, CodingErrorAction.REPORT);
    } catch (CharacterCodingException e) {
      return null;
    }
  }

  static String decodeUtf8(byte[] value, CodingErrorAction malformed)
      throws CharacterCodingException {
    return StandardCharsets.UTF_8
        .newDecoder()
        .onMalformedInput(malformed)
        .onUnmappableCharacter(malformed)
        .decode(ByteBuffer.wrap(value))
        .toString();
  }

  /**
   * {@code keyplane.reference.events.nested_deeper_than}: the running depth of brackets outside
   * strings, where a string ends as the regular expression {@code "[^"\\]*(?:\\.[^"\\]*)*"} ends
   * it, so an unterminated one is not cut out.
   */
  static boolean nestedDeeperThan(byte[] value, int depth) {
    int brackets = 0;
    for (byte c : value) {
      if (c == '[' || c == '{') {
        brackets++;
      }
    }
    if (brackets <= depth) {
      return false;
    }
    int level = 0;
    int i = 0;
    while (i < value.length) {
      byte c = value[i];
      if (c == '"') {
        int end = stringEnd(value, i);
        if (end >= 0) {
          i = end + 1;
          continue;
        }
      }
      int folded = (c & 0xff) | 32;
      if (folded == '{') {
        level++;
        if (level > depth) {
          return true;
        }
      } else if (folded == '}') {
        level--;
      }
      i++;
    }
    return false;
  }

  /** The index of the quote that closes the string opened at {@code start}, or -1. */
  static int stringEnd(byte[] value, int start) {
    int i = start + 1;
    while (i < value.length) {
      if (value[i] == '\\') {
        if (i + 1 >= value.length) {
          return -1;
        }
        i += 2;
      } else if (value[i] == '"') {
        return i;
      } else {
        i++;
      }
    }
    return -1;
  }

  /** Whether a name or a string at any depth holds a surrogate without its pair. */
  static boolean holdsLoneSurrogate(JsonNode event) {
    ArrayDeque<JsonNode> pending = new ArrayDeque<>();
    pending.push(event);
    while (!pending.isEmpty()) {
      JsonNode node = pending.pop();
      if (node.isObject()) {
        Iterator<Map.Entry<String, JsonNode>> fields = node.fields();
        while (fields.hasNext()) {
          Map.Entry<String, JsonNode> field = fields.next();
          if (loneSurrogate(field.getKey())) {
            return true;
          }
          pending.push(field.getValue());
        }
      } else if (node.isArray()) {
        node.forEach(pending::push);
      } else if (node.isTextual() && loneSurrogate(node.textValue())) {
        return true;
      }
    }
    return false;
  }

  static boolean loneSurrogate(String s) {
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (Character.isHighSurrogate(c)) {
        if (i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
          i++;
          continue;
        }
        return true;
      }
      if (Character.isLowSurrogate(c)) {
        return true;
      }
    }
    return false;
  }

  /**
   * One stage's routed-key table of one version, as the driver exported it: {@code
   * keyplane.routing.routedkeys.RoutedKeyTable.route}, its salts already searched.
   */
  static final class Table {
    /** Each version's tables by stage, its file read once per executor. */
    private static final Map<String, Map<String, Table>> KEPT =
        Collections.synchronizedMap(
            new LinkedHashMap<>(16, 0.75f, true) {
              private static final long serialVersionUID = 1L;

              @Override
              protected boolean removeEldestEntry(Map.Entry<String, Map<String, Table>> eldest) {
                return size() > KEPT_VERSIONS;
              }
            });

    final int n;
    /** The routes of tabled and hot keys, each with its instance. */
    final Map<String, List<String>> routes = new HashMap<>();
    final Map<String, Integer> instances = new HashMap<>();
    /** {@code fold_instance} of each natural partition; null when every instance is active. */
    final int[] fold;
    final boolean split;
    private final Map<String, String> folded = new HashMap<>();

    Table(JsonNode stage, int n) {
      this.n = n;
      JsonNode fold = stage.get("fold");
      if (fold == null || fold.isNull()) {
        this.fold = null;
      } else {
        this.fold = new int[n];
        for (int i = 0; i < n; i++) {
          this.fold[i] = fold.get(i).asInt();
        }
      }
      Iterator<Map.Entry<String, JsonNode>> keys = stage.get("routes").fields();
      while (keys.hasNext()) {
        Map.Entry<String, JsonNode> key = keys.next();
        List<String> values = new ArrayList<>();
        for (JsonNode route : key.getValue()) {
          values.add(route.get(0).asText());
          instances.put(route.get(0).asText(), route.get(1).asInt());
        }
        routes.put(key.getKey(), values);
      }
      this.split = stage.get("split").asBoolean();
    }

    /** Every stage's table in stored version {@code version}, its file read once per executor. */
    static Map<String, Table> of(String store, int version, int n) throws IOException {
      String name = store + "\u0000" + version + "\u0000" + n;
      Map<String, Table> tables = KEPT.get(name);
      if (tables == null) {
        Path file = file(store, version, n);
        if (!Files.isRegularFile(file)) {
          throw new IOException(
              "v" + version + ": no routed-key table " + file + "; the driver writes it when it "
                  + "first plans a batch on that version, and the executors must see the store");
        }
        tables = new HashMap<>();
        Iterator<Map.Entry<String, JsonNode>> stages =
            READER.readTree(Files.readAllBytes(file)).get("operators").fields();
        while (stages.hasNext()) {
          Map.Entry<String, JsonNode> stage = stages.next();
          tables.put(stage.getKey(), new Table(stage.getValue(), n));
        }
        KEPT.put(name, tables);
      }
      return tables;
    }

    /** Every stage's table of {@code version}, if the driver has written them yet. */
    static void preload(String store, int version, int n) throws IOException {
      if (Files.isRegularFile(file(store, version, n))) {
        of(store, version, n);
      }
    }

    static Path file(String store, int version, int n) {
      return Paths.get(store, "jvm-tables", "v" + version + "-p" + n + ".json");
    }

    List<String> route(String key) {
      List<String> found = routes.get(key);
      if (found != null) {
        return found;
      }
      if (fold == null && standsAlone(key)) {
        return List.of(key);
      }
      synchronized (folded) {
        String value = folded.get(key);
        if (value == null) {
          value = fallbackValue(key);
          if (folded.size() > FOLDS_KEPT) {
            folded.clear();
          }
          folded.put(key, value);
        }
        return List.of(value);
      }
    }

    /** {@code RoutedKeyTable._fallback_value}: the key itself, or salted onto its instance. */
    String fallbackValue(String key) {
      int natural = RoutedStages.partition(key, n);
      int target = fold == null ? natural : fold[natural];
      if (target == natural && standsAlone(key)) {
        return key;
      }
      String prefix = escaped(key) ? ESCAPE + key : key;
      for (int salt = 0; salt < TRIES_PER_PARTITION * n; salt++) {
        String candidate = prefix + SEPARATOR + salt;
        if (RoutedStages.partition(candidate, n) == target) {
          return candidate;
        }
      }
      throw new IllegalStateException(
          "no salt sends " + key + " to partition " + target + " of " + n);
    }

    int instanceOf(String route) {
      Integer instance = instances.get(route);
      return instance != null ? instance : RoutedStages.partition(route, n);
    }
  }

  /** {@code keyplane.routing.routedkeys.escaped}. */
  static boolean escaped(String key) {
    return key.isEmpty()
        || key.startsWith(RoutedStages.CONTROL_PREFIX)
        || key.startsWith(RoutedStages.CLOSING_PREFIX)
        || key.startsWith(ESCAPE);
  }

  /** {@code keyplane.routing.routedkeys.stands_alone}. */
  static boolean standsAlone(String key) {
    return !key.contains(SEPARATOR) && !escaped(key);
  }

  /**
   * {@code keyplane.routing.handoff.LeastLoadedRoutes}: greedy-d over this task's own counts (001
   * §4.1.2); every tuple counts, ties go to the earlier route.
   */
  static final class LeastLoaded {
    private final Table table;
    private final Map<Integer, Long> load = new HashMap<>();

    LeastLoaded(Table table) {
      this.table = table;
    }

    String pick(List<String> routes, long tuples) {
      if (!table.split) {
        return routes.get(0);
      }
      String best = routes.get(0);
      long least = load.getOrDefault(table.instanceOf(best), 0L);
      for (int i = 1; i < routes.size(); i++) {
        long l = load.getOrDefault(table.instanceOf(routes.get(i)), 0L);
        if (l < least) {
          best = routes.get(i);
          least = l;
        }
      }
      load.merge(table.instanceOf(best), tuples, Long::sum);
      return best;
    }
  }
}
