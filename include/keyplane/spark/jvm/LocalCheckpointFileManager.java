package keyplane.spark.jvm;

import java.io.BufferedOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.OutputStream;
import java.nio.file.Files;
import java.nio.file.FileSystemException;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileAlreadyExistsException;
import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager;

/**
 * Spark's checkpoint file manager over the {@code FileSystem} API, whose atomic writes to the
 * local file system create and rename their files in Java instead of through Hadoop.
 *
 * <p>Why: without Hadoop's native library (the pyspark wheel has none), Hadoop's local file
 * system sets the permission of every file it creates by starting a {@code chmod} process, and a
 * streaming query creates several files in every micro-batch: its offset and commit log entries on
 * the driver, and a changelog for each partition of each stateful operator in its tasks. Here a
 * file is opened with {@code java.nio}, which creates it with the mode Hadoop would have set (0666
 * under the process's umask, Hadoop's default umask being the usual 022) in one system call. The
 * file has no Hadoop {@code .crc} checksum beside it, as with Spark's {@code FileContext} manager;
 * Hadoop reads a file without one unchecked.
 *
 * <p>The rename keeps the contract of Spark's {@code RenameHelperMethods}, which Hadoop's local
 * {@code rename} does not: it refuses an existing target, so Spark's own manager silently keeps
 * the old file where Spark asked to overwrite it (a state store's changelog written again by a
 * replayed batch) and leaves the temporary file behind. Here an overwrite is {@code rename(2)},
 * which replaces the target atomically, and a write that must not overwrite links the file
 * under its name ({@code link(2)} fails if the name exists) and then removes the temporary
 * name, so two writers of one offset log entry cannot both succeed.
 *
 * <p>Listing, reading and deleting go through Hadoop as before. Paths of any other file system
 * (HDFS, S3) take Spark's path unchanged.
 */
public class LocalCheckpointFileManager extends FileSystemBasedCheckpointFileManager {
  private final boolean localFiles;

  public LocalCheckpointFileManager(Path path, Configuration hadoopConf) {
    super(path, hadoopConf);
    this.localFiles = "file".equals(fs().getUri().getScheme());
  }

  @Override
  public FSDataOutputStream createTempFile(Path path) {
    if (!localFiles) {
      return super.createTempFile(path);
    }
    java.nio.file.Path file = local(path);
    try {
      Files.createDirectories(file.getParent());
      OutputStream out =
          Files.newOutputStream(
              file,
              StandardOpenOption.CREATE,
              StandardOpenOption.TRUNCATE_EXISTING,
              StandardOpenOption.WRITE);
      return new FSDataOutputStream(new BufferedOutputStream(out, 64 * 1024), null);
    } catch (IOException e) {
      throw LocalCheckpointFileManager.<RuntimeException>unchecked(e);
    }
  }

  @Override
  public void renameTempFile(Path srcPath, Path dstPath, boolean overwriteIfPossible) {
    if (!localFiles) {
      super.renameTempFile(srcPath, dstPath, overwriteIfPossible);
      return;
    }
    java.nio.file.Path source = local(srcPath);
    java.nio.file.Path target = local(dstPath);
    try {
      if (overwriteIfPossible) {
        Files.move(source, target, StandardCopyOption.ATOMIC_MOVE);
      } else {
        moveWithoutOverwrite(source, target);
      }
    } catch (java.nio.file.FileAlreadyExistsException e) {
      try {
        Files.deleteIfExists(source);
      } catch (IOException ignored) {
        // The temporary file stays; the error below is the one to report.
      }
      throw LocalCheckpointFileManager.<RuntimeException>unchecked(
          new FileAlreadyExistsException(dstPath + " exists: a write that may not overwrite it"));
    } catch (IOException e) {
      throw LocalCheckpointFileManager.<RuntimeException>unchecked(e);
    }
  }

  /**
   * {@code link(2)}, atomic and never replacing, then the temporary name removed; where the file
   * system has no hard links, a check and a rename, which is what Spark's own manager does.
   */
  private static void moveWithoutOverwrite(java.nio.file.Path source, java.nio.file.Path target)
      throws IOException {
    try {
      Files.createLink(target, source);
    } catch (java.nio.file.FileAlreadyExistsException e) {
      throw e; // a FileSystemException too, but the answer, not a missing hard link
    } catch (UnsupportedOperationException | FileSystemException e) {
      if (Files.exists(target)) {
        throw new java.nio.file.FileAlreadyExistsException(target.toString());
      }
      Files.move(source, target, StandardCopyOption.ATOMIC_MOVE);
      return;
    }
    Files.delete(source);
  }

  private java.nio.file.Path local(Path path) {
    return new File(fs().makeQualified(path).toUri()).toPath();
  }

  /**
   * Throws {@code e} as it is: Spark's callers, written in Scala, handle an {@code IOException}
   * from a file manager (a full disk, a missing permission) whatever Java's checked exceptions say.
   */
  @SuppressWarnings("unchecked")
  private static <E extends Throwable> E unchecked(Throwable e) throws E {
    throw (E) e;
  }
}
