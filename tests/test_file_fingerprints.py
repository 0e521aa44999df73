"""What the tasks of a synchronous cluster state about their training files."""

import pytest

from trainer import file_fingerprints

pytestmark = pytest.mark.fast


def _csv(path, labels):
  path.write_text('x,label\n' + ''.join(f'{i},{y}\n'
                                        for i, y in enumerate(labels)))
  return path


def test_a_file_of_the_same_name_and_size_with_other_rows_differs(tmp_path):
  # A worker's stale copy: the same length, the labels flipped.
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  chief = _csv(tmp_path / 'a' / 'train.csv', [0, 1, 1, 0])
  worker = _csv(tmp_path / 'b' / 'train.csv', [1, 0, 0, 1])
  assert chief.stat().st_size == worker.stat().st_size
  mine = file_fingerprints.of_patterns([str(chief)])
  theirs = file_fingerprints.of_patterns([str(worker)])
  assert mine[0][1] == theirs[0][1]  # Sizes.
  assert mine[0][2] != theirs[0][2]  # Digests.
  again = file_fingerprints.of_patterns([str(tmp_path / 'a' / '*.csv')])
  assert again == mine


def _image_folder(root, classes):
  for label, files in classes.items():
    (root / label).mkdir(parents=True)
    for name, content in files.items():
      (root / label / name).write_bytes(content)
  return root


def test_an_image_folder_is_stated_file_by_file(tmp_path):
  full = _image_folder(tmp_path / 'full', {
      'cat': {'0.jpg': b'c0', '1.jpg': b'c1'}, 'dog': {'0.jpg': b'd0'}})
  stated = file_fingerprints.of_patterns([str(full)])
  assert [row[0] for row in stated] == [
      str(full / 'cat' / '0.jpg'), str(full / 'cat' / '1.jpg'),
      str(full / 'dog' / '0.jpg'), str(full / 'cat') + '/',
      str(full / 'dog') + '/']
  # A copy interrupted halfway: a file missing.
  half = _image_folder(tmp_path / 'half', {
      'cat': {'0.jpg': b'c0'}, 'dog': {'0.jpg': b'd0'}})
  # The classes' contents swapped, names and sizes kept.
  swapped = _image_folder(tmp_path / 'swapped', {
      'cat': {'0.jpg': b'd0', '1.jpg': b'c1'}, 'dog': {'0.jpg': b'c0'}})

  def relative(root):
    return [[row[0][len(str(root)):], *row[1:]]
            for row in file_fingerprints.of_patterns([str(root)])]

  assert relative(half) != relative(full)
  assert relative(swapped) != relative(full)
  copy = _image_folder(tmp_path / 'copy', {
      'cat': {'0.jpg': b'c0', '1.jpg': b'c1'}, 'dog': {'0.jpg': b'd0'}})
  assert relative(copy) == relative(full)
  # What the image reader does not read does not count: a .DS_Store, an
  # editor's lock file (a broken link) beside the images.
  (copy / '.DS_Store').write_bytes(b'x')
  (copy / 'cat' / 'notes.txt').write_bytes(b'x')
  (copy / 'cat' / '.#notes.txt').symlink_to(tmp_path / 'nowhere')
  assert relative(copy) == relative(full)
  # An empty class folder is another class.
  (copy / 'bird').mkdir()
  assert relative(copy) != relative(full)


def test_an_unreadable_file_is_stated_not_raised(tmp_path):
  (tmp_path / 'part-0.csv').symlink_to(tmp_path / 'nowhere')
  assert file_fingerprints.of_patterns([str(tmp_path / 'part-*.csv')]) == [
      [str(tmp_path / 'part-0.csv'), 'unreadable']]


def test_many_files_are_named_and_a_spread_of_them_read(tmp_path,
                                                         monkeypatch):
  monkeypatch.setattr(file_fingerprints, 'SAMPLED_FILES', 4)
  for i in range(10):
    (tmp_path / f'part-{i}.csv').write_text(f'x\n{i}\n')
  stated = file_fingerprints.of_patterns([str(tmp_path / 'part-*.csv')])
  assert len(stated) == 10
  read = [i for i, row in enumerate(stated) if len(row) == 3]
  assert read == [0, 3, 6, 9]  # First and last included.
  assert all(len(row) == 1 for i, row in enumerate(stated) if i not in read)


def test_a_large_file_is_read_in_blocks_up_to_its_last_byte(tmp_path,
                                                            monkeypatch):
  monkeypatch.setattr(file_fingerprints, 'WHOLE_BYTES', 1000)
  monkeypatch.setattr(file_fingerprints, 'BLOCK_BYTES', 10)
  monkeypatch.setattr(file_fingerprints, 'BLOCKS', 4)
  data = bytearray(b'a' * 5000)
  path = tmp_path / 'big.bin'
  path.write_bytes(bytes(data))
  before = file_fingerprints.of_patterns([str(path)])
  for offset in (0, 4999):  # The first and the last block are read.
    changed = bytearray(data)
    changed[offset] = ord('b')
    path.write_bytes(bytes(changed))
    assert file_fingerprints.of_patterns([str(path)]) != before
  # Between the blocks: not read (the documented limit of a large file).
  changed = bytearray(data)
  changed[100] = ord('b')
  path.write_bytes(bytes(changed))
  assert file_fingerprints.of_patterns([str(path)]) == before


def test_no_pattern_states_nothing():
  assert file_fingerprints.of_patterns([]) == []
  assert file_fingerprints.of_patterns(None) == []
